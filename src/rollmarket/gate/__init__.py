"""The gate: validators, budget reports and the off-policy budget controller (OPBC).

>>> from rollmarket.gate import budget_report, decide
>>> decision = decide(budget_report(group, trainer_logprobs))
"""

from .budget import budget_from_arrays, budget_report, router_flip_rate, valid_token_mask
from .config import GateConfig
from .integrity import (
    SigningKeyError,
    generate_signing_key,
    hash_matches,
    load_public_key,
    load_signing_key,
    public_key_b64,
    sign_group,
    signature_valid,
    write_signing_key,
)
from .opbc import decide, reasons_for, reject, status_for, triage_on_arrival
from .validate import Finding, check_against_lease, check_group, check_provenance, fingerprint_refused, reasons_of

__all__ = [name for name in dir() if not name.startswith("_")]
