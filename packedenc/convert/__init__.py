"""Checkpoints in and out: HF safetensors (`hf.py` + one key map per family; `reader.py` reads the
files, `files.py` writes them safely) and GiGL (`gigl.py`)."""

from packedenc.convert.hf import from_state_dict, load, save, to_state_dict

__all__ = ["load", "save", "from_state_dict", "to_state_dict"]
