"""The assembly: what `initialize` builds the engine's parts with.

Owns the refusals DeepSpeed makes at ``initialize`` (_refusals.py) and the config's ZeRO-3 leaf
modules marked on the model (_leaf_config.py).
"""
