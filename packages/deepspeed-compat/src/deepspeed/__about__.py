# DeepSpeed's release whose behaviour the adapters follow, and zstack's label: vendor builds of
# DeepSpeed carry one the same way (0.19.8+hpu...), and version checks such as Transformers'
# `deepspeed>=0.9.3` compare the release part only.
__version__ = "0.19.8+zstack.0.1"
