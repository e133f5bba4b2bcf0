"""The built-in verifiers, one file per family. Importing this package registers them all."""

from .code import CodeVerifier
from .compound import CompoundVerifier
from .exact import ExactVerifier
from .instructions import InstructionsVerifier
from .json_schema import JsonSchemaVerifier
from .llm_judge import LlmJudgeVerifier
from .math import MathVerifier
from .math_verify import MathVerifyVerifier
from .multiple_choice import MultipleChoiceVerifier
from .numeric import NumericVerifier
from .tool_use import ToolUseVerifier

__all__ = ["CodeVerifier", "CompoundVerifier", "ExactVerifier", "InstructionsVerifier", "JsonSchemaVerifier",
           "LlmJudgeVerifier", "MathVerifier", "MathVerifyVerifier", "MultipleChoiceVerifier", "NumericVerifier",
           "ToolUseVerifier"]
