"""``deepspeed.ops``: DeepSpeed's optimizer classes, on torch's fused kernels (zengine.ops), and
its op builders' answers (`op_builder`): every op's feature is available without a build."""

from deepspeed.ops import adagrad, adam, aio, lion, op_builder

__all__ = ["__compatible_ops__", "adagrad", "adam", "aio", "lion", "op_builder"]

# DeepSpeed's table of which ops can be built here, which its code and tests consult
__compatible_ops__ = {
    builder.NAME: builder().is_compatible()
    for builder in (
        op_builder.AsyncIOBuilder,
        op_builder.CPUAdagradBuilder,
        op_builder.CPUAdamBuilder,
        op_builder.CPULionBuilder,
        op_builder.FusedAdamBuilder,
        op_builder.FusedLionBuilder,
    )
}
