"""The built-in verifiers, one file per family. Importing this package registers them all."""

from .compound import CompoundVerifier
from .exact import ExactVerifier
from .json_schema import JsonSchemaVerifier
from .math import MathVerifier
from .numeric import NumericVerifier
from .tool_use import ToolUseVerifier

__all__ = ["CompoundVerifier", "ExactVerifier", "JsonSchemaVerifier", "MathVerifier", "NumericVerifier",
           "ToolUseVerifier"]
