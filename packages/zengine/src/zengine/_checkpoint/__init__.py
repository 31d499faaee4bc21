"""Checkpoints: the engine's state saved and loaded, and the files written and read.

Owns ``save_checkpoint`` / ``load_checkpoint`` (_save_load.py) over torch.distributed.checkpoint
(_dcp.py, _pieces.py), what is saved of an engine (_state.py), the manifest saying what a
checkpoint is of (_manifest.py), the directory, ``latest`` and the CRCs (_files.py), the ranks'
agreement (_sync.py), a pipeline's checkpoint in stages (_stages.py, _stage_layout.py,
_stage_reshape.py), ``zengine consolidate`` and zero_to_fp32's reading (_consolidate.py), the
16-bit model save (_save_16bit.py), and Hugging Face safetensors: the format (_safetensors.py),
a checkpoint's files (_safetensors_checkpoint.py) and a load into a ZeRO-3 model
(_safetensors_load.py). Its errors are in _errors.py.
"""

from zengine._checkpoint._safetensors_load import load_safetensors_into

__all__ = ["load_safetensors_into"]
