"""DeepSpeed's ``tests/unit`` helper modules, so DeepSpeed's own tests import them unchanged."""
