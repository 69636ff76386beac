"""The planted-bug catalogue (positive controls) and clean runs (negative controls) that
calibrate the ladder: prefill.py for compare_models, decode.py for compare_decode. The
engine never imports this room (tests/test_imports.py); tests and bench/controls.py do."""

from .decode import DECODE_CONTROLS, LATE_SLOTS, DecodeControl, check_decode, control_side, run_decode_control
from .prefill import CONTROLS, LAYER, Control, check, clean, findings_after, hf_side, run_control

__all__ = ["CONTROLS", "DECODE_CONTROLS", "LATE_SLOTS", "LAYER", "Control", "DecodeControl", "check",
           "check_decode", "clean", "control_side", "findings_after", "hf_side", "run_control", "run_decode_control"]
