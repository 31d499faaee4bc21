"""The config: DeepSpeed's keys read, validated and frozen into an `EngineConfig`.

Owns the section models with DeepSpeed's keys and defaults (_sections.py), the keys of DeepSpeed
features zengine does not have and what a config holding one gets (_deepspeed_keys.py), the
errors that name a key's full path (_errors.py), the reduction options the config sets
(_grad_reduction.py), the whole config and `load_config` (_engine_config.py), and DeepSpeed's
command-line flags (_args.py). It reads and checks; what a section does to the model, the
optimizer or the offload lives with them.
"""
