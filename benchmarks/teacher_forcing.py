"""Teacher forcing: the trainer engine (chunked lm-head) against the naive full-logits path.

For one batch of (prompt, response) pairs, every response token's logprob and its distribution's
entropy, several ways (the defaults: engine-eager, engine-torch, naive, naive-logprobs on the CPU;
every body, naive and numerics on CUDA):

    engine-eager    TrainerEngine.score_batch with the eager body: model body once, then lm-head +
                    softmax statistics over chunks of positions (4,096 on CUDA, through the fused
                    Triton kernel of engines/fused.py; 1,024 on the CPU); also returns routed experts
    engine-liger    the engine with Liger-Kernel's fused RMSNorm, SwiGLU and rotary embedding in
                    the body (engines/body.py; CUDA, needs the liger-kernel wheel)
    engine-compiled the engine with each decoder layer torch.compile'd (the default body on CUDA;
                    the compile happens in the warm-up call; its time is first_call_s)
    engine-compiled-liger  both: the Liger kernels inside the compiled layers
    engine-torch    the eager engine with the fused head kernel off (the torch chunk math, 1,024
                    positions a chunk): what runs where Triton is missing
    naive           model(ids).logits.float().log_softmax(-1), gather the targets, and the entropy
                    −Σ p·log p: the whole [tokens x vocab] float32 matrix and its log-softmax exist
                    at once, and the entropy makes two more of the response's size
    naive-logprobs  the naive path without the entropy (what the engine was first compared with)
    numerics        not a speed row: every body's bf16 logprobs against the float32 model's on the
                    same weights, at several depths (the model cut after its first d layers), and
                    whether each meets the criterion (NUMERICS_CRITERION below)

On CUDA each engine row also has the card's bf16 matmul peak, measured in the same process (the
best of several large bf16 matmuls), and the fraction of it the row reaches by 2 · parameters ·
tokens per second.

Each (shape, method) runs in its own child process so peak memory is its own: on CUDA,
torch.cuda.max_memory_allocated above what the weights and inputs hold; on the CPU, the kernel's
peak resident set (VmHWM, reset through /proc/self/clear_refs) above the resident set before the
call (tracemalloc does not see torch's allocations). Time is the best of --repeats runs after a
warm-up (the median is in the JSON too). The logprobs and entropies of the first and last
sequences are compared with the naive path's (max |Δ|). Shapes with a path use those weights; the
others are random-weight Qwen3 models of that shape, built in the child (only torch, transformers
and rollmarket are needed).

--sweep times the lm-head + statistics alone on one shape's hidden states (torch and fused paths
at several chunk sizes, the kernel's block and warp counts, a torch.compile'd chunk function, the
naive head) and the model body, eager and compiled (--compile-body): the numbers behind the
engine's chunk size and the breakdown of where the time goes.

    python benchmarks/teacher_forcing.py                       # CPU: tiny models + a big-vocab shape
    python benchmarks/teacher_forcing.py --device cuda         # Qwen3-0.6B, 1.7B, 4B shapes, bf16, 16k tokens:
                                                               # every body, naive, numerics (~4-5 min on an H100)
    python benchmarks/teacher_forcing.py --device cuda --shapes qwen3-1.7b --tokens 32768
    python benchmarks/teacher_forcing.py --device cuda --sweep --compile-body qwen3-0.6b,qwen3-4b
"""

from __future__ import annotations

import argparse
import gc
import importlib.metadata
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
QWEN3_VOCAB = 151936

# Shapes: a model (a path, or a Qwen3 config for random weights) and a batch (total tokens,
# tokens per sequence, prompt tokens per sequence). Qwen3 configs follow the published ones.
SHAPES: dict[str, dict] = {
    "tiny-dense": dict(path="models/tiny-dense", tokens=2048, seq=512, prompt=64),
    "tiny-moe": dict(path="models/tiny-moe", tokens=2048, seq=512, prompt=64),
    "bigvocab": dict(config=dict(vocab_size=QWEN3_VOCAB, hidden_size=512, intermediate_size=1536,
                                 num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=4,
                                 head_dim=64),
                     tokens=4096, seq=512, prompt=64),
    "qwen3-0.6b": dict(config=dict(vocab_size=QWEN3_VOCAB, hidden_size=1024, intermediate_size=3072,
                                   num_hidden_layers=28, num_attention_heads=16,
                                   num_key_value_heads=8, head_dim=128),
                       tokens=16384, seq=2048, prompt=256),
    "qwen3-1.7b": dict(config=dict(vocab_size=QWEN3_VOCAB, hidden_size=2048, intermediate_size=6144,
                                   num_hidden_layers=28, num_attention_heads=16,
                                   num_key_value_heads=8, head_dim=128),
                       tokens=16384, seq=2048, prompt=256),
    "qwen3-4b": dict(config=dict(vocab_size=QWEN3_VOCAB, hidden_size=2560, intermediate_size=9728,
                                 num_hidden_layers=36, num_attention_heads=32,
                                 num_key_value_heads=8, head_dim=128),
                     tokens=16384, seq=2048, prompt=256),
}
DEFAULT_SHAPES = {"cpu": "tiny-dense,tiny-moe,bigvocab", "cuda": "qwen3-0.6b,qwen3-1.7b,qwen3-4b"}
DEFAULT_PRECISION = {"cpu": "fp32", "cuda": "bf16"}
BODY_OF = {"engine-eager": "eager", "engine-liger": "liger", "engine-compiled": "compiled",
           "engine-compiled-liger": "compiled-liger", "engine-torch": "eager",
           "engine-compiled-autotune": "compiled", "engine-compiled-graphs": "compiled",
           "engine-compiled-cudagraphs": "compiled", "engine-eager-cudagraphs": "eager"}
PROFILES = ("profile", "profile-cudagraphs")
"""Where one forward's GPU time goes (torch.profiler), with the compiled body, without and with graphs."""
GRAPHED = ("engine-compiled-cudagraphs", "engine-eager-cudagraphs", "profile-cudagraphs")
"""Methods whose engine replays the body as CUDA graphs (``TrainerEngine(graphs=True)``)."""
COMPILE_MODE_OF = {"engine-compiled-autotune": "max-autotune-no-cudagraphs",
                   "engine-compiled-graphs": "reduce-overhead"}
"""torch.compile modes other than the default, measured as rows of their own."""
METHODS = (*BODY_OF, "naive", "naive-logprobs", "numerics", *PROFILES)
DEFAULT_METHODS = {"cpu": "engine-eager,engine-torch,naive,naive-logprobs",
                   "cuda": "engine-eager,engine-liger,engine-compiled,engine-compiled-liger,naive,numerics"}
BASELINE = "naive"
NUMERICS_CRITERION = (
    "over all scored tokens, the mean and the 99.9th percentile of |logprob − reference logprob|, "
    "against each of two float32 references (the float32 model whose weights the bf16 ones round, "
    "and the bf16 weights computed in float32), are each at most the larger of the two eager bf16 "
    "runs' (the engine's batch, and one sequence a forward: two roundings of the same eager code, "
    "whose spread is eager bf16's own)")
"""When a body's logprobs stay within the eager bf16 path's own distance from float32."""


# ----------------------------------------------------------------------------- child side


def _build(shape: dict, precision: str, device: str):
    import torch

    from rollmarket.engines.loading import LoadedModel, ModelInfo, load_model
    from rollmarket.engines.precision import apply_precision, parse_precision

    if "path" in shape:
        return load_model(ROOT / shape["path"], precision, device)
    from transformers import Qwen3Config, Qwen3ForCausalLM

    profile = parse_precision(precision)
    config = Qwen3Config(**shape["config"], tie_word_embeddings=True,
                         max_position_embeddings=max(4096, shape["seq"]))
    torch.manual_seed(0)
    with torch.device(device):
        model = Qwen3ForCausalLM(config)
    apply_precision(model, profile).eval()
    info = ModelInfo(path="", name="random", architecture="Qwen3ForCausalLM",
                     vocab_size=config.vocab_size, num_layers=config.num_hidden_layers,
                     num_moe_layers=0, num_experts=0, top_k=0, checkpoint_digest="",
                     tokenizer_hash="", model_config_hash="", eos_token_ids=(0,),
                     max_context_tokens=config.max_position_embeddings)
    return LoadedModel(model=model, tokenizer=None, info=info, precision=profile,
                       device=torch.device(device))


def _memory_reader(device: str):
    """(start, peak_above_start): a pair of callables around the measured call."""
    import torch

    if device.startswith("cuda"):
        def start() -> int:
            torch.cuda.synchronize()
            gc.collect()
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
            return torch.cuda.memory_allocated()

        def peak() -> int:
            torch.cuda.synchronize()
            return torch.cuda.max_memory_allocated()
        return start, peak

    def status(field: str) -> int:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
        raise RuntimeError(f"no {field} in /proc/self/status")

    def start_cpu() -> int:
        gc.collect()
        Path("/proc/self/clear_refs").write_text("5")  # resets VmHWM to the current RSS
        return status("VmRSS")

    return start_cpu, lambda: status("VmHWM")


def child(name: str, method: str, precision: str, device: str, tokens: int, repeats: int,
          chunk: int) -> dict:
    import numpy as np
    import torch

    from rollmarket.engines import TrainerEngine, fused
    from rollmarket.engines.body import BodyUnavailable

    shape = dict(SHAPES[name], tokens=tokens or SHAPES[name]["tokens"])
    if device == "cpu":
        torch.set_num_threads(os.cpu_count() or 1)
    loaded = _build(shape, precision, device)
    model, vocab = loaded.model, loaded.info.vocab_size
    B, S, P = shape["tokens"] // shape["seq"], shape["seq"], shape["prompt"]
    rng = np.random.default_rng(0)
    ids_BS = rng.integers(3, vocab, size=(B, S))
    pairs = [(row[:P], row[P:]) for row in ids_BS]
    ids_dev_BS = torch.from_numpy(ids_BS).to(device)
    if method == "engine-torch":
        fused.available = lambda: False  # what an install without Triton runs
        chunk = chunk or 1024
    result = dict(shape=name, method=method, device=device, precision=precision, batch=B, seq=S,
                  prompt=P, tokens=B * S, scored_tokens=B * (S - P), vocab=vocab,
                  parameters=sum(p.numel() for p in model.parameters()))
    engine = None
    if method in BODY_OF or method in PROFILES:
        try:
            engine = TrainerEngine(loaded, chunk=chunk or None, body=BODY_OF.get(method),
                                   graphs=method in GRAPHED)
            if method in COMPILE_MODE_OF:
                from rollmarket.engines.body import BodyPatch

                engine.body_patch = BodyPatch(engine.body, "compiled", compile_mode=COMPILE_MODE_OF[method])
                result["compile_mode"] = COMPILE_MODE_OF[method]
        except (BodyUnavailable, ValueError) as exc:  # ValueError: CUDA graphs asked for off CUDA
            return dict(result, error=f"body unavailable: {exc}")
        result.update(body=engine.body_patch.body, fused=list(engine.body_patch.fused), chunk=engine.chunk,
                      fused_kernel=fused.available() and device.startswith("cuda"))

    def first_and_last(rows_BT) -> np.ndarray:
        return np.concatenate([np.asarray(rows_BT[0]), np.asarray(rows_BT[-1])])

    @torch.no_grad()
    def run_engine() -> tuple[np.ndarray, np.ndarray | None]:
        scored = engine.score_batch(pairs)
        return (first_and_last([tf.logprobs_T for tf in scored]),
                first_and_last([tf.entropies_T for tf in scored]))

    @torch.no_grad()
    def run_naive() -> tuple[np.ndarray, np.ndarray | None]:
        logp_BTV = model(input_ids=ids_dev_BS).logits.float().log_softmax(-1)[:, P - 1:-1]
        logprobs_BT = logp_BTV.gather(-1, ids_dev_BS[:, P:, None]).squeeze(-1)
        entropies_BT = -(logp_BTV.exp() * logp_BTV).sum(-1)
        return first_and_last(logprobs_BT.cpu()), first_and_last(entropies_BT.cpu())

    @torch.no_grad()
    def run_naive_logprobs() -> tuple[np.ndarray, np.ndarray | None]:
        logp_BSV = model(input_ids=ids_dev_BS).logits.float().log_softmax(-1)
        logprobs_BT = logp_BSV[:, P - 1:-1].gather(-1, ids_dev_BS[:, P:, None]).squeeze(-1)
        return first_and_last(logprobs_BT.cpu()), None

    def sync() -> None:
        if device.startswith("cuda"):
            torch.cuda.synchronize()

    run = run_engine if engine is not None else {"naive": run_naive,
                                                 "naive-logprobs": run_naive_logprobs}[method]
    if method in PROFILES:
        profiled = _profile(run, device)
        if "error" not in profiled:
            profiled.update(matmul_peak_tflops=matmul_peak_flops() / 1e12,
                            attention_flops=attention_flops(model.config, B, S))
        return dict(result, **profiled)
    start_mem, peak_mem = _memory_reader(device)
    try:
        sync()
        started = time.perf_counter()
        logprobs, entropies = run()
        sync()
        result["first_call_s"] = time.perf_counter() - started
        base = start_mem()
        run()
        peak = peak_mem()
        times = []
        for _ in range(repeats):
            sync()
            started = time.perf_counter()
            run()
            sync()
            times.append(time.perf_counter() - started)
    except torch.OutOfMemoryError as exc:
        return dict(result, error=f"out of memory: {str(exc).splitlines()[0]}")
    # Best of the repeats: on a shared machine the minimum is the run least disturbed by others.
    seconds = min(times)
    if device.startswith("cuda"):
        peak_flops = matmul_peak_flops()
        attention = attention_flops(model.config, B, S)
        result.update(matmul_peak_tflops=peak_flops / 1e12,
                      model_tflops=2 * result["parameters"] * B * S / seconds / 1e12,
                      fraction_of_peak=2 * result["parameters"] * B * S / seconds / peak_flops,
                      attention_flops=attention,
                      fraction_of_peak_with_attention=(2 * result["parameters"] * B * S + attention)
                      / seconds / peak_flops)
    if engine is not None and engine.graphs_error:
        result["graphs_error"] = engine.graphs_error
    elif engine is not None and engine.graphs is not None:
        result["graph_captures"] = engine.graphs.captures
    return dict(result, seconds=seconds, seconds_median=statistics.median(times),
                tokens_per_s=B * S / seconds, peak_extra_bytes=peak - base,
                peak_total_bytes=peak, logprobs_sample=[float(x) for x in logprobs],
                entropies_sample=None if entropies is None else [float(x) for x in entropies])


def attention_flops(config, batch: int, seq: int) -> float:
    """The causal attention's matmul FLOPs in one forward, which 2·params·tokens leaves out:
    QKᵀ and PV are each 2·S·S·(heads·head_dim) per sequence and layer, halved by the causal mask.
    At 2,048-token sequences this is 20% on top of 2·params·tokens for the 0.6B shape, 5% for 4B."""
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    width = config.num_attention_heads * head_dim
    return 2 * 2 * batch * seq * seq * width / 2 * config.num_hidden_layers


def _profile(run, device: str, top: int = 30) -> dict:
    """Where one warm forward's GPU time goes: torch.profiler's kernels by device time, grouped
    into matmuls, attention, Triton (fused elementwise and the statistics kernel) and the rest."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    if not device.startswith("cuda"):
        return dict(error="the profile method needs CUDA")
    run()
    run()
    walls = []
    for _ in range(3):  # the wall time beside the kernels' sum: the gap is GPU idle between kernels
        torch.cuda.synchronize()
        started = time.perf_counter()
        run()
        torch.cuda.synchronize()
        walls.append(time.perf_counter() - started)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        run()
        torch.cuda.synchronize()
    kernels = []
    for event in prof.key_averages():
        us = getattr(event, "self_device_time_total", None) or getattr(event, "self_cuda_time_total", 0)
        if us > 0:
            kernels.append(dict(name=event.key[:120], ms=us / 1e3, count=event.count))
    kernels.sort(key=lambda k: -k["ms"])

    def group(name: str) -> str:
        low = name.lower()
        if any(t in low for t in ("gemm", "cutlass", "xmma", "nvjet", "cublas", "matmul")):
            return "matmul"
        if any(t in low for t in ("flash", "fmha", "attention", "sdpa")):
            return "attention"
        if "triton" in low:
            return "triton"
        return "other"

    groups: dict[str, float] = {}
    for k in kernels:
        groups[group(k["name"])] = groups.get(group(k["name"]), 0.0) + k["ms"]
    return dict(device_ms=sum(k["ms"] for k in kernels), wall_ms=1000 * min(walls), groups_ms=groups,
                kernels=kernels[:top])


# ----------------------------------------------------------------------------- sweep (CUDA)


def sweep_head(name: str, precision: str, tokens: int) -> dict:
    """Where the time goes on one shape: the body, and each way of doing lm-head + statistics."""
    import numpy as np
    import torch
    from triton.testing import do_bench

    from rollmarket.engines import chunked_token_stats, fused

    device = "cuda"
    shape = dict(SHAPES[name], tokens=tokens or SHAPES[name]["tokens"])
    loaded = _build(shape, precision, device)
    model, vocab = loaded.model, loaded.info.vocab_size
    B, S, P = shape["tokens"] // shape["seq"], shape["seq"], shape["prompt"]
    ids_BS = torch.from_numpy(np.random.default_rng(0).integers(3, vocab, size=(B, S))).to(device)
    body, head = model.get_decoder(), model.lm_head
    out: dict = dict(shape=name, precision=precision, batch=B, seq=S, prompt=P, vocab=vocab,
                     variants=[])

    def bench(fn, rep: int = 300) -> float:
        return float(do_bench(fn, warmup=50, rep=rep, return_mode="median"))

    def peak_extra(fn) -> int:
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        fn()
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated() - base

    with torch.no_grad():
        # The body as model(ids) runs it (with its default KV cache), and with an all-ones mask.
        out["body_ms"] = bench(lambda: body(input_ids=ids_BS).last_hidden_state, rep=1500)
        mask_BS = torch.ones_like(ids_BS)
        out["body_with_mask_ms"] = bench(
            lambda: body(input_ids=ids_BS, attention_mask=mask_BS).last_hidden_state, rep=1500)
        hidden_NH = body(input_ids=ids_BS).last_hidden_state[:, P - 1:-1].reshape(-1, head.in_features)
        hidden_NH = hidden_NH.contiguous()
        targets_N = ids_BS[:, P:].reshape(-1).contiguous()
        N = hidden_NH.shape[0]
        # Reference: float64 statistics of the model-precision logits of the first 512 rows, so
        # the check measures the statistics, not the lm-head's own rounding.
        ref_logp = head(hidden_NH[:512]).double().log_softmax(-1)
        ref_lp = ref_logp.gather(-1, targets_N[:512, None]).squeeze(-1)
        ref_ent = -(ref_logp.exp() * ref_logp).sum(-1)
        del ref_logp
        out["reference_entropy_mean"] = float(ref_ent.mean())

        def record(label: str, fn, **extra) -> None:
            fn()  # compile / warm
            lp, ent = fn()
            row = dict(label=label, ms=bench(fn), peak_extra_bytes=peak_extra(fn), **extra)
            if lp is not None:
                row["max_abs_lp"] = float((lp[:512].double() - ref_lp).abs().max())
                row["max_abs_ent"] = float((ent[:512].double() - ref_ent).abs().max())
            out["variants"].append(row)
            print(json.dumps(row), file=sys.stderr)

        def matmul_only(chunk: int):
            for start in range(0, N, chunk):
                head(hidden_NH[start:start + chunk])
            return None, None

        record("lm-head matmul only, chunk 4096", lambda: matmul_only(4096), chunk=4096)
        for chunk in (1024, 4096):
            record(f"torch chunk math, chunk {chunk}", lambda c=chunk: chunked_token_stats(
                hidden_NH, head, targets_N, chunk=c, fused=False), chunk=chunk)
        for chunk in (1024, 2048, 4096, 8192, N):
            record(f"fused kernel, chunk {chunk}", lambda c=chunk: chunked_token_stats(
                hidden_NH, head, targets_N, chunk=c), chunk=chunk)

        logits_CV = head(hidden_NH[:4096])
        for block in (2048, 4096, 8192):
            for warps in (4, 8, 16):
                record(f"kernel alone on 4096 rows, BLOCK {block}, {warps} warps",
                       lambda b=block, w=warps, x=logits_CV: fused.token_stats(
                           x, targets_N[:4096], block=b, num_warps=w),
                       block=block, num_warps=warps)
        del logits_CV

        def chunk_math(logits_CV, targets_C):
            z_CV = logits_CV.float()
            m_C1 = z_CV.amax(-1, keepdim=True)
            shifted_CV = z_CV - m_C1
            e_CV = shifted_CV.exp()
            s_C = e_CV.sum(-1)
            log_s_C = s_C.log()
            lp_C = shifted_CV.gather(-1, targets_C[:, None]).squeeze(-1) - log_s_C
            return lp_C, log_s_C - (e_CV * shifted_CV).sum(-1) / s_C

        compiled = torch.compile(chunk_math, dynamic=False)

        def compiled_stats(chunk: int = 4096):
            lps, ents = [], []
            for start in range(0, N, chunk):
                stop = min(start + chunk, N)
                if stop - start < chunk:  # one shape only: pad the last chunk
                    rows = torch.zeros(chunk, hidden_NH.shape[1], dtype=hidden_NH.dtype, device=device)
                    rows[:stop - start] = hidden_NH[start:stop]
                    tg = torch.zeros(chunk, dtype=targets_N.dtype, device=device)
                    tg[:stop - start] = targets_N[start:stop]
                    lp, ent = compiled(head(rows), tg)
                    lp, ent = lp[:stop - start], ent[:stop - start]
                else:
                    lp, ent = compiled(head(hidden_NH[start:stop]), targets_N[start:stop])
                lps.append(lp)
                ents.append(ent)
            return torch.cat(lps), torch.cat(ents)

        started = time.perf_counter()
        compiled_stats()
        torch.cuda.synchronize()
        record("torch.compile chunk math, chunk 4096", compiled_stats, chunk=4096,
               compile_s=time.perf_counter() - started)

        def naive_head():
            logp_NV = head(hidden_NH).float().log_softmax(-1)
            lp = logp_NV.gather(-1, targets_N[:, None]).squeeze(-1)
            return lp, -(logp_NV.exp() * logp_NV).sum(-1)

        record("naive head (float32 log_softmax + entropy)", naive_head)
    return out


def sweep_compile_body(name: str, precision: str, tokens: int, mode: str) -> dict:
    """Compile time and steady time of the model body (no KV cache, as the engine runs it), eager
    and compiled: ``whole`` (torch.compile of the body module) or ``regional`` (each decoder layer
    compiled in place; one graph serves them all)."""
    import numpy as np
    import torch
    from triton.testing import do_bench

    shape = dict(SHAPES[name], tokens=tokens or SHAPES[name]["tokens"])
    loaded = _build(shape, precision, "cuda")
    B, S = shape["tokens"] // shape["seq"], shape["seq"]
    rng = np.random.default_rng(0)
    body = loaded.model.get_decoder()
    ids = torch.from_numpy(rng.integers(3, loaded.info.vocab_size, size=(B, S))).cuda()
    with torch.no_grad():
        eager_ms = float(do_bench(lambda: body(input_ids=ids, use_cache=False).last_hidden_state,
                                  warmup=100, rep=1500, return_mode="median"))
    if mode == "whole":
        fn = torch.compile(body)
    else:
        for layer in body.layers:
            layer.compile()
        fn = body
    out = dict(shape=name, mode=mode, batch=B, seq=S, eager_body_ms=eager_ms)
    with torch.no_grad():
        for label, seq in (("first", S), ("second_shape", S - 256), ("third_shape", S - 512)):
            ids = torch.from_numpy(rng.integers(3, loaded.info.vocab_size, size=(B, seq))).cuda()
            torch.cuda.synchronize()
            started = time.perf_counter()
            fn(input_ids=ids, use_cache=False)
            torch.cuda.synchronize()
            out[f"{label}_call_s"] = time.perf_counter() - started
        ids = torch.from_numpy(rng.integers(3, loaded.info.vocab_size, size=(B, S))).cuda()
        out["body_ms"] = float(do_bench(lambda: fn(input_ids=ids, use_cache=False).last_hidden_state,
                                        warmup=100, rep=1500, return_mode="median"))
    print(json.dumps(out), file=sys.stderr)
    return out


def matmul_peak_flops(sizes: tuple[int, ...] = (8192, 16384), repeats: int = 8) -> float:
    """The card's bf16 matmul rate in FLOP/s: the best of ``repeats`` timed n×n×n matmuls per size,
    after a warm-up (the peak the fraction of peak is taken against, measured in the same process)."""
    import torch

    best = 0.0
    for n in sizes:
        a_NN = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
        b_NN = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
        out_NN = torch.empty(n, n, device="cuda", dtype=torch.bfloat16)
        for _ in range(3):
            torch.matmul(a_NN, b_NN, out=out_NN)
        for _ in range(repeats):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            torch.matmul(a_NN, b_NN, out=out_NN)
            end.record()
            end.synchronize()
            best = max(best, 2 * n**3 / (start.elapsed_time(end) / 1000))
        del a_NN, b_NN, out_NN
    torch.cuda.empty_cache()
    return best


def numerics(name: str, device: str, tokens: int) -> dict:
    """Every body's bf16 logprobs against two float32 references, by depth, and the criterion.

    One random-weight model: scored in float32 (the float32 model), then with its weights rounded
    to bf16 but still computed in float32 (the exact answer of the bf16 weights: what is left of a
    body's distance is its own rounding of the computation), then with the weights in bf16 (as
    ``_build`` makes every bf16 model) by each body. Depth d runs the first d decoder layers, then
    the final norm and the head (the decoder reads ``config.num_hidden_layers`` for its loop), so
    the table shows how each body's distance grows layer by layer.
    """
    from dataclasses import replace

    import numpy as np
    import torch

    from rollmarket.engines import TrainerEngine
    from rollmarket.engines.precision import apply_precision, parse_precision

    shape = dict(SHAPES[name], tokens=tokens or SHAPES[name]["tokens"])
    B, S, P = shape["tokens"] // shape["seq"], shape["seq"], shape["prompt"]
    loaded = _build(shape, "fp32", device)
    config = loaded.model.config
    layers = config.num_hidden_layers
    depths = sorted({1, layers // 4, layers // 2, 3 * layers // 4, layers} - {0})
    ids_BS = np.random.default_rng(0).integers(3, loaded.info.vocab_size, size=(B, S))
    pairs = [(row[:P], row[P:]) for row in ids_BS]

    def score(engine, depth: int) -> np.ndarray:
        config.num_hidden_layers = depth
        try:
            return np.concatenate([tf.logprobs_T for tf in engine.score_batch(pairs)])
        finally:
            config.num_hidden_layers = layers

    reference = TrainerEngine(loaded, body="eager")
    refs = {"": {d: score(reference, d) for d in depths}}
    with torch.no_grad():
        for param in loaded.model.parameters():
            param.data = param.data.to(torch.bfloat16).float()
    refs["_exact"] = {d: score(reference, d) for d in depths}
    bf16 = parse_precision("bf16")
    loaded = replace(loaded, model=apply_precision(loaded.model, bf16), precision=bf16)
    out: dict = dict(shape=name, method="numerics", device=device, batch=B, seq=S, prompt=P,
                     layers=layers, depths=depths, scored_tokens=B * (S - P),
                     criterion=NUMERICS_CRITERION, variants=[])
    eager_lp = None
    # (label, body, engine options, by depth): the depth sweep is for the explanation (eager against
    # compiled); the other rows need only the whole model.
    variants = (("eager", "eager", {}, True), ("eager, one sequence a forward", "eager", {"max_batch_tokens": S}, False),
                ("liger", "liger", {}, False), ("compiled", "compiled", {}, True),
                ("compiled-liger", "compiled-liger", {}, False))
    for label, body, options, sweep in variants:
        if body.startswith("compiled"):
            torch._dynamo.reset()  # no graph of another variant is reused
        by_depth = []
        try:
            engine = TrainerEngine(loaded, body=body, **options)
            for d in depths if sweep else depths[-1:]:  # the last depth is the whole model
                lp = score(engine, d)
                row = dict(depth=d)
                for suffix, ref in refs.items():
                    delta = np.abs(lp - ref[d])
                    row.update({f"mean{suffix}": float(delta.mean()), f"p999{suffix}": float(np.quantile(delta, 0.999)),
                                f"max{suffix}": float(delta.max())})
                by_depth.append(row)
        except Exception as exc:  # one body that fails (a missing wheel, a kernel error) is a row, not the run
            out["variants"].append(dict(label=label, body=body, error=f"{type(exc).__name__}: {exc}"[:1000]))
            print(f"{label}: {out['variants'][-1]['error']}", file=sys.stderr)
            continue
        finally:
            engine = None
            gc.collect()
        eager_lp = lp if eager_lp is None else eager_lp
        row = dict(label=label, body=body, by_depth=by_depth, **{k: v for k, v in by_depth[-1].items() if k != "depth"},
                   mean_vs_eager=float(np.abs(lp - eager_lp).mean()), max_vs_eager=float(np.abs(lp - eager_lp).max()))
        out["variants"].append(row)
        print(json.dumps(row), file=sys.stderr)
    eager_rows = [v for v in out["variants"] if v["body"] == "eager" and "error" not in v]
    keys = ("mean", "p999", "mean_exact", "p999_exact")
    bound = {k: max(v[k] for v in eager_rows) for k in keys}
    out["bound"] = bound
    for v in out["variants"]:
        if "error" not in v:
            v["meets_criterion"] = all(v[k] <= bound[k] for k in keys)
    return out


# ----------------------------------------------------------------------------- parent side


def _run_child(name: str, method: str, args) -> dict:
    cmd = [sys.executable, __file__, "--child", name, method, "--precision", args.precision,
           "--device", args.device, "--tokens", str(args.tokens), "--repeats", str(args.repeats),
           "--chunk", str(args.chunk)]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    if proc.returncode != 0 or not lines:
        return dict(shape=name, method=method, error=(proc.stderr or proc.stdout)[-2000:])
    return json.loads(lines[-1])


def _gb(n: float | None) -> str:
    return "-" if n is None else f"{n / 2**30:.2f}"


def _max_abs(a, b) -> float | None:
    if a is None or b is None:
        return None
    import numpy as np

    return float(np.max(np.abs(np.asarray(a) - np.asarray(b))))


def _compare(rows: dict[str, dict]) -> None:
    """Ratios and differences of every method against the two naive ones, in place."""
    for row in rows.values():
        if "error" in row or "tokens_per_s" not in row:
            continue
        for ref_name, suffix in ((BASELINE, "naive"), ("naive-logprobs", "naive_logprobs")):
            ref = rows.get(ref_name)
            if ref is None or "error" in ref or ref is row:
                continue
            row[f"speedup_vs_{suffix}"] = row["tokens_per_s"] / ref["tokens_per_s"]
            row[f"peak_extra_ratio_vs_{suffix}"] = row["peak_extra_bytes"] / ref["peak_extra_bytes"]
        ref = rows.get(BASELINE)
        if ref is not None and "error" not in ref and ref is not row:
            row["max_abs_logprob_diff_vs_naive"] = _max_abs(row["logprobs_sample"], ref["logprobs_sample"])
            row["max_abs_entropy_diff_vs_naive"] = _max_abs(row.get("entropies_sample"),
                                                            ref.get("entropies_sample"))


def _meta(args, kind: str) -> dict:
    meta = {"date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            "machine": platform.platform(), "cpus": os.cpu_count(), "python": platform.python_version(),
            "command": " ".join(sys.argv), "device": args.device, "precision": args.precision}
    import torch

    if kind == "cuda":
        from rollmarket.engines.body import CUDA_BODY

        meta["gpu"] = torch.cuda.get_device_name(0)
        meta["cuda_default_body"] = CUDA_BODY
    meta["torch"] = torch.__version__
    meta["transformers"] = __import__("transformers").__version__
    try:
        meta["triton"] = __import__("triton").__version__
    except ImportError:
        meta["triton"] = None
    try:
        meta["liger_kernel"] = importlib.metadata.version("liger-kernel")
    except importlib.metadata.PackageNotFoundError:
        meta["liger_kernel"] = None
    return meta


def _x(value: float | None, digits: int = 2) -> str:
    return "" if value is None else f"{value:.{digits}f}x"


def _e(value: float | None) -> str:
    return "" if value is None else f"{value:.1e}"


def _sweep(args, names: list[str], console) -> dict:
    from rich.table import Table

    results = []
    for name in names:
        console.log(f"sweep {name}")
        results.append(_run_child(name, "sweep", args))
        if name in args.compile_body.split(","):
            # compile-whole also exists: it ran past 75 s on the 0.6B shape, so it is not in the sweep.
            console.log(f"sweep {name}: compile-regional")
            results.append(_run_child(name, "compile-regional", args))
    for res in results:
        if "error" in res:
            console.print(f"[red]{res.get('shape')} {res.get('method')}: {res['error'][-1500:]}")
            continue
        if "variants" in res:
            table = Table(title=f"{res['shape']}: body {res['body_ms']:.1f} ms "
                                f"({res['body_with_mask_ms']:.1f} with a mask); lm-head + statistics "
                                f"over {res['batch'] * (res['seq'] - res['prompt']):,} positions")
            for col in ("variant", "ms", "peak extra GiB", "max |Δ| logprob", "max |Δ| entropy"):
                table.add_column(col, justify="left" if col == "variant" else "right")
            for v in res["variants"]:
                table.add_row(v["label"], f"{v['ms']:.2f}", _gb(v["peak_extra_bytes"]),
                              _e(v.get("max_abs_lp")), _e(v.get("max_abs_ent")))
            console.print(table)
        else:
            console.print(f"{res['shape']} body eager {res['eager_body_ms']:.1f} ms, compiled "
                          f"({res['mode']}) {res['body_ms']:.1f} ms; "
                          f"first call {res['first_call_s']:.1f} s, new shapes "
                          f"{res['second_shape_call_s']:.1f} s, {res['third_shape_call_s']:.1f} s")
    return {"results": results}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cpu", help="cpu or cuda (one GPU).")
    parser.add_argument("--shapes", default=None,
                        help=f"Comma-separated, from {', '.join(SHAPES)}. Default: "
                             f"{DEFAULT_SHAPES['cpu']} on cpu, {DEFAULT_SHAPES['cuda']} on cuda.")
    parser.add_argument("--methods", default=None,
                        help=f"Comma-separated, from {', '.join(METHODS)}. Default: "
                             f"{DEFAULT_METHODS['cpu']} on cpu, {DEFAULT_METHODS['cuda']} on cuda.")
    parser.add_argument("--precision", default=None,
                        help="fp32, bf16, fp16 or fp8. Default: fp32 on cpu, bf16 on cuda.")
    parser.add_argument("--tokens", type=int, default=0,
                        help="Tokens per batch (prompt + response, all sequences); 0 = the shape's.")
    parser.add_argument("--chunk", type=int, default=0,
                        help="Positions per lm-head call for the engine rows; 0 = the engine's default.")
    parser.add_argument("--repeats", type=int, default=5, help="Timed runs per case (best of).")
    parser.add_argument("--sweep", action="store_true",
                        help="CUDA: time the lm-head + statistics variants and the body instead.")
    parser.add_argument("--compile-body", default="", metavar="SHAPES",
                        help="With --sweep: also time these shapes' body with compiled layers.")
    parser.add_argument("--out", type=Path, default=None,
                        help="JSON output. Default: benchmarks/results/teacher_forcing-cpu.json on cpu, "
                             "teacher_forcing-bodies-cuda.json on cuda (teacher_forcing-sweep-cuda.json "
                             "with --sweep).")
    parser.add_argument("--child", nargs=2, metavar=("SHAPE", "METHOD"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    kind = "cuda" if args.device.startswith("cuda") else "cpu"
    args.precision = args.precision or DEFAULT_PRECISION[kind]

    if args.child:
        name, method = args.child
        if method == "sweep":
            res = sweep_head(name, args.precision, args.tokens)
        elif method == "numerics":
            res = numerics(name, args.device, args.tokens)
        elif method.startswith("compile-"):
            res = sweep_compile_body(name, args.precision, args.tokens, method.split("-", 1)[1])
        else:
            res = child(name, method, args.precision, args.device, args.tokens, args.repeats, args.chunk)
        print(json.dumps(res))
        return

    from rich.console import Console
    from rich.table import Table

    console = Console(width=max(Console().width, 160))
    names = (args.shapes or DEFAULT_SHAPES[kind]).split(",")
    unknown = [n for n in names if n not in SHAPES]
    if unknown:
        parser.error(f"unknown shape(s) {unknown}; choose from {', '.join(SHAPES)}")
    if args.sweep:
        if kind != "cuda":
            parser.error("--sweep needs --device cuda")
        report = _sweep(args, names, console)
        out = args.out or ROOT / "benchmarks" / "results" / "teacher_forcing-sweep-cuda.json"
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps({"meta": _meta(args, kind), **report}, indent=2) + "\n")
        console.print(f"wrote {out}")
        return

    methods = (args.methods or DEFAULT_METHODS[kind]).split(",")
    if any(m not in METHODS for m in methods):
        parser.error(f"unknown method in {methods}; choose from {', '.join(METHODS)}")
    results = []
    for name in names:
        rows = {}
        for method in methods:
            console.log(f"{name} / {method} on {args.device} at {args.precision}")
            rows[method] = _run_child(name, method, args)
        _compare(rows)
        for row in rows.values():
            row.pop("logprobs_sample", None)
            row.pop("entropies_sample", None)
            results.append(row)

    speed = [r for r in results if r["method"] not in ("numerics", *PROFILES)]
    table = Table(title=f"Teacher forcing on {args.device} at {args.precision}")
    for col in ("shape", "method", "chunk", "batch×seq", "tokens/s", "peak extra GiB",
                "speed vs naive", "speed vs naive-lp", "peak vs naive", "peak vs naive-lp",
                "of matmul peak", "max |Δ| logprob", "max |Δ| entropy"):
        table.add_column(col, justify="left" if col in ("shape", "method") else "right")
    for row in speed:
        if "error" in row:
            table.add_row(row["shape"], row["method"], "", "", "error: " + row["error"][-60:])
            continue
        peak = row.get("fraction_of_peak")
        table.add_row(
            row["shape"], row["method"], str(row.get("chunk", "")), f"{row['batch']}×{row['seq']}",
            f"{row['tokens_per_s']:,.0f}", _gb(row["peak_extra_bytes"]),
            _x(row.get("speedup_vs_naive")), _x(row.get("speedup_vs_naive_logprobs")),
            _x(row.get("peak_extra_ratio_vs_naive"), 3),
            _x(row.get("peak_extra_ratio_vs_naive_logprobs"), 3),
            "" if peak is None else f"{100 * peak:.0f}% of {row['matmul_peak_tflops']:.0f} TF/s",
            _e(row.get("max_abs_logprob_diff_vs_naive")), _e(row.get("max_abs_entropy_diff_vs_naive")))
    console.print(table)
    for res in results:
        if res["method"] in PROFILES and "groups_ms" in res:
            groups = ", ".join(f"{k} {v:.1f} ms" for k, v in sorted(res["groups_ms"].items(), key=lambda kv: -kv[1]))
            console.print(f"{res['shape']} {res['method']} ({res.get('body', '')} body): {res['device_ms']:.1f} ms "
                          f"of kernels in {res.get('wall_ms', float('nan')):.1f} ms of wall time: {groups}")
            for k in res["kernels"][:12]:
                console.print(f"    {k['ms']:8.2f} ms  ×{k['count']:<5} {k['name']}")
        if res["method"] != "numerics":
            continue
        if "error" in res:
            console.print(f"[red]{res['shape']} numerics: {res['error'][-1500:]}")
            continue
        table = Table(title=f"{res['shape']}: |Δ logprob| against the float32 model (same weights), "
                            f"mean / p99.9 / max, after d of {res['layers']} layers (last column: against "
                            f"the bf16 weights computed in float32)")
        table.add_column("body", justify="left")
        for d in res["depths"]:
            table.add_column(f"d = {d}", justify="right")
        for col in ("exact: mean / p99.9", "vs eager mean / max", "meets"):
            table.add_column(col, justify="right")
        for v in res["variants"]:
            if "error" in v:
                table.add_row(v["label"], "error: " + v["error"][-80:])
                continue
            at = {x["depth"]: f"{x['mean']:.1e} / {x['p999']:.1e} / {x['max']:.1e}" for x in v["by_depth"]}
            table.add_row(v["label"], *[at.get(d, "") for d in res["depths"]],
                          f"{_e(v['mean_exact'])} / {_e(v['p999_exact'])}",
                          f"{_e(v['mean_vs_eager'])} / {_e(v['max_vs_eager'])}", "yes" if v["meets_criterion"] else "no")
        console.print(table)

    out = args.out or ROOT / "benchmarks" / "results" / (
        "teacher_forcing-bodies-cuda.json" if kind == "cuda" else "teacher_forcing-cpu.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"meta": _meta(args, kind), "results": results}, indent=2) + "\n")
    console.print(f"wrote {out}")


if __name__ == "__main__":
    main()
