"""The tiny shipped models, their chat template and build, and the task world they are trained on.

The template tests lock the tool-call wire format other parts parse (the OpenAI server, the
agents): do not "fix" them without a decision.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from rollmarket.models.build import BuildConfig, build
from rollmarket.models.template import parse_tool_calls, render_chat
from rollmarket.tasks import FAMILIES, generate, generate_split, generate_world, load_world, run_tool
from rollmarket.tasks.families import MEMORIZED
from rollmarket.tasks.world import world_json

ROOT = Path(__file__).resolve().parents[1]
SHIPPED = {name: ROOT / "models" / name for name in ("tiny-dense", "tiny-moe", "tiny-start")}
SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<tool_call>", "</tool_call>", "<tool_response>",
           "</tool_response>", "<think>", "</think>"]
CALC = {"type": "function", "function": {"name": "calculator", "description": "Evaluate an arithmetic expression.",
                                         "parameters": {"type": "object", "properties": {"expression": {"type": "string"}},
                                                        "required": ["expression"]}}}


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(SHIPPED["tiny-dense"])


def _conversation(arguments):
    return [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "What is 17 * 23?"},
        {"role": "assistant", "content": "", "tool_calls": [
            {"id": "call_0", "type": "function", "function": {"name": "calculator", "arguments": arguments}}]},
        {"role": "tool", "tool_call_id": "call_0", "content": "391"},
        {"role": "assistant", "content": "391"},
    ]


def test_chat_template_renders_hermes_tool_calls(tokenizer):
    """The wire format: tools in the system turn, one-line JSON calls, tool results in a user turn."""
    text = tokenizer.apply_chat_template(_conversation({"expression": "17 * 23"}), tools=[CALC], tokenize=False)
    assert text.startswith("<|im_start|>system\nYou are terse.\n\n# Tools\n")
    assert "<tools>\n" + json.dumps(CALC) + "\n</tools>" in text
    assert text.endswith(
        "<|im_start|>user\nWhat is 17 * 23?<|im_end|>\n"
        "<|im_start|>assistant\n<tool_call>\n"
        '{"name": "calculator", "arguments": {"expression": "17 * 23"}}\n'
        "</tool_call><|im_end|>\n"
        "<|im_start|>user\n<tool_response>\n391\n</tool_response><|im_end|>\n"
        "<|im_start|>assistant\n391<|im_end|>\n")
    as_string = tokenizer.apply_chat_template(_conversation('{"expression": "17 * 23"}'), tools=[CALC], tokenize=False)
    assert as_string == text
    assert render_chat(_conversation({"expression": "17 * 23"}), [CALC]) == text
    prompt = tokenizer.apply_chat_template(_conversation({})[:2], add_generation_prompt=True, tokenize=False)
    assert prompt == "<|im_start|>system\nYou are terse.<|im_end|>\n<|im_start|>user\nWhat is 17 * 23?<|im_end|>\n" \
                     "<|im_start|>assistant\n"
    content, calls = parse_tool_calls('<tool_call>\n{"name": "calculator", "arguments": {"expression": "1 + 2"}}\n'
                                      "</tool_call>")
    assert (content, calls) == ("", [{"name": "calculator", "arguments": {"expression": "1 + 2"}}])
    assert parse_tool_calls("<tool_call>\nnot json\n</tool_call>")[1] == []


def test_tokenizer_round_trips_and_keeps_special_tokens_whole(tokenizer):
    for token in SPECIAL:
        assert len(tokenizer(token, add_special_tokens=False)["input_ids"]) == 1, token
    assert tokenizer.eos_token == "<|im_end|>" and tokenizer.pad_token == "<|endoftext|>"
    samples = [
        tokenizer.apply_chat_template(_conversation({"expression": "17 * 23"}), tools=[CALC], tokenize=False),
        "Grüße, 東京! 🙂 tabs\tand  spaces\n\n\r\nend ", "x = {'a': [1, 2.5e-3]}; print(x)  # ok", "",
    ]
    for text in samples:
        assert tokenizer.decode(tokenizer(text, add_special_tokens=False)["input_ids"]) == text
    assert 1024 <= len(tokenizer) <= 2048
    config = json.loads((SHIPPED["tiny-dense"] / "tokenizer_config.json").read_text())
    assert "chat_template" in config


@pytest.mark.parametrize("name", sorted(SHIPPED))
def test_shipped_models_load_and_report(name):
    path = SHIPPED[name]
    config = AutoConfig.from_pretrained(path)
    assert config.num_hidden_layers >= 4
    if name in ("tiny-moe", "tiny-start"):
        assert config.architectures == ["Qwen3MoeForCausalLM"]
        assert config.num_experts >= 8 and config.num_experts_per_tok == 2 and config.norm_topk_prob
    else:
        assert config.architectures == ["Qwen3ForCausalLM"]
    model = AutoModelForCausalLM.from_pretrained(path)
    assert type(model).__name__ == config.architectures[0]
    assert all(p.dtype.is_floating_point and p.element_size() == 4 for p in model.parameters())
    generation = json.loads((path / "generation_config.json").read_text())
    tokenizer = AutoTokenizer.from_pretrained(path)
    assert generation["eos_token_id"] == [tokenizer.convert_tokens_to_ids("<|im_end|>"),
                                          tokenizer.convert_tokens_to_ids("<|endoftext|>")]
    report = json.loads((path / "build_report.json").read_text())
    families = report["eval"]["families"]
    assert set(families) == set(FAMILIES)
    for family, row in families.items():
        assert 0 < row["accuracy"] < 1 and row["n"] >= 30, (family, row)


def test_shipped_models_fit_the_size_budget():
    sizes = {name: (path / "model.safetensors").stat().st_size for name, path in SHIPPED.items()}
    assert all(size < 30 * 1024 * 1024 for size in sizes.values()), sizes
    assert sum(sizes.values()) <= 40 * 1024 * 1024, sizes


def test_mixed_demonstrations_guess_wrong_and_carry_no_task_signal():
    """Guessed demonstrations answer without a tool and are wrong under the task's verifier; the
    demonstrator is drawn per copy at about `tool_share` (a 4-sigma binomial band), so copies of one
    task disagree; plain tasks keep their gold; the same seed gives the same data."""
    from rollmarket.models.headroom import mixed_demonstrations
    from rollmarket.tasks import check_answer

    world = load_world()
    tasks = generate_split("train", {"calculator": 150, "lookup": 100, "chain": 100, "plain": 30}, world)
    demos = mixed_demonstrations(tasks, world, tool_share=0.4, copies=3, seed=5)
    assert len(demos) == 3 * len(tasks)
    tool = [d for d in demos if d.family != "plain"]
    gold = [d for d in tool if len(d.gold) > 1]
    share, n = len(gold) / len(tool), len(tool)
    assert abs(share - 0.4) < 4 * (0.4 * 0.6 / n) ** 0.5, share
    for demo in tool:
        if len(demo.gold) == 1:
            assert "tool_calls" not in demo.gold[0]
            assert not check_answer(demo.verifier, demo.gold[0]["content"], demo.expected), demo
    assert all(d.gold == t.gold for d, t in zip(demos, [t for t in tasks for _ in range(3)]) if d.family == "plain")
    kinds = [tuple(len(d.gold) > 1 for d in demos[i:i + 3]) for i in range(0, len(demos), 3)]
    assert sum(len(set(k)) > 1 for k in kinds) > len(kinds) // 4  # copies of a task mix demonstrators
    again = mixed_demonstrations(tasks, world, tool_share=0.4, copies=3, seed=5)
    assert [d.gold for d in again] == [d.gold for d in demos]
    assert [d.gold for d in mixed_demonstrations(tasks, world, tool_share=0.4, copies=3, seed=6)] != \
        [d.gold for d in demos]


def test_tiny_start_has_headroom_that_tiny_moe_lacks():
    """Measured again here (real sampled multi-turn runs with the reference tools, another seed and
    fewer tasks than the build): tiny-start's pass@8 is far above its pass@1 on held-out arithmetic,
    a gap much wider than the one the build measured for tiny-moe, which calls the tool every time."""
    from rollmarket.models.evaluate import sampled_pass_at_k

    world = load_world()
    tasks = generate_split("heldout", {"calculator": 16}, world, families=("calculator",))
    model = AutoModelForCausalLM.from_pretrained(SHIPPED["tiny-start"])
    start = sampled_pass_at_k(model, AutoTokenizer.from_pretrained(SHIPPED["tiny-start"]), tasks, world,
                              samples=8, seed=1)
    report = json.loads((SHIPPED["tiny-start"] / "build_report.json").read_text())["headroom"]
    moe = report["parent"]
    assert 0.1 <= start["pass@1"] <= 0.5 and start["pass@8"] >= 0.6, start
    assert 0.1 <= start["tool_rate"] <= 0.7 and moe["tool_rate"] > 0.95, (start, moe)
    assert start["pass@8"] - start["pass@1"] > moe["pass@8"] - moe["pass@1"] + 0.2, (start, moe)
    assert report["model"]["tasks"] >= 64 and report["model"]["pass@8"] >= 0.7, report


def test_quick_build_writes_loadable_model_dirs(tmp_path):
    reports = build(BuildConfig.quick(out=tmp_path, steps=2, moe_steps=2))
    assert reports["tiny-start"]["headroom"]["model"]["samples"] == 2
    for name in ("tiny-dense", "tiny-moe", "tiny-start"):
        path = tmp_path / name
        assert {"config.json", "generation_config.json", "model.safetensors", "tokenizer.json",
                "tokenizer_config.json", "build_report.json"} <= {p.name for p in path.iterdir()}
        model = AutoModelForCausalLM.from_pretrained(path)
        tokenizer = AutoTokenizer.from_pretrained(path)
        ids = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True,
                                            tokenize=True, return_dict=True, return_tensors="pt")["input_ids"]
        assert model(ids).logits.shape[-1] == len(tokenizer)
        assert reports[name]["train"]["steps_done"] == (4 if name == "tiny-start" else 2)
        assert set(json.loads((path / "build_report.json").read_text())["eval"]["families"]) == set(FAMILIES)


def test_world_and_tasks_are_deterministic():
    assert world_json(generate_world(0)) == world_json(load_world()), "shipped world.json is stale"
    assert world_json(generate_world(1)) != world_json(generate_world(0))
    for family in FAMILIES:
        first, again = generate(family, 20, seed=1), generate(family, 20, seed=1)
        assert [t.digest for t in first] == [t.digest for t in again]
        assert [t.digest for t in first] != [t.digest for t in generate(family, 20, seed=2)]
    heldout = generate_split("heldout", 20)
    train = generate_split("train", 50, exclude_prompts={t.prompt for t in heldout})
    tool_families = [f for f in FAMILIES if f not in MEMORIZED]
    assert not {t.prompt for t in train if t.family in tool_families} & {t.prompt for t in heldout}


def test_gold_trajectories_replay_with_the_reference_tools():
    world = load_world()
    for family in FAMILIES:
        for task in generate(family, 10, seed=3):
            assert task.messages[0]["role"] == "system" and task.messages[1]["role"] == "user"
            assert task.gold[-1] == {"role": "assistant", "content": task.expected}
            for call, result in zip(task.gold[:-1:2], task.gold[1::2]):
                fn = call["tool_calls"][0]["function"]
                assert run_tool(fn["name"], fn["arguments"], world=world, files=task.files) == result["content"]
            if family == "plain":
                assert len(task.gold) == 1
    assert run_tool("calculator", {"expression": "17 * 23"}, world=world, files={}) == "391"
    assert run_tool("calculator", {"expression": "__import__('os')"}, world=world, files={}).startswith("error:")
    assert run_tool("read_file", {"path": "../etc/passwd"}, world=world, files=world.files).startswith("error:")
    assert run_tool("nope", {}, world=world, files={}).startswith("error:")
    town = world.towns[0]
    assert str(town.population) in run_tool("web_search", {"query": f"{town.name} population"}, world=world, files={})


def test_models_cli_builds_and_describes(tmp_path):
    """`rollmarket models build --quick` writes both models through the CLI, and `models info`
    reads one back (architecture, experts, per-family accuracy)."""
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-m", "rollmarket", "models", "build", "--quick", "--out",
                           str(tmp_path)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    assert (tmp_path / "tiny-moe" / "model.safetensors").exists()
    info = subprocess.run([sys.executable, "-m", "rollmarket", "models", "info", str(tmp_path / "tiny-moe")],
                          capture_output=True, text=True, timeout=120)
    assert info.returncode == 0, info.stderr
    assert "Qwen3MoeForCausalLM" in info.stdout and "8" in info.stdout and "calculator" in info.stdout


def test_building_tiny_start_without_tiny_moe_is_a_usage_error(tmp_path):
    """`--only start` fine-tunes <out>/tiny-moe: without it the CLI says so and writes nothing."""
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-m", "rollmarket", "models", "build", "--quick", "--only", "start",
                           "--out", str(tmp_path)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 2, done.stdout[-2000:] + done.stderr[-2000:]
    assert "tiny-moe" in done.stderr and "Traceback" not in done.stderr
    assert list(tmp_path.iterdir()) == []
