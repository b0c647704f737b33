"""The plan and shapes test_group.py and group_engine.py share."""

from memra_kv import plans

CAPACITY = 256


def group_plan(layers=4, heads=8):
    """A dense plan: `layers` layers of `heads` K/V heads of 32 in bf16 (whole heads per rank)."""
    return plans.model_plan(
        [plans.kv_layer(i, 32, heads, formats=plans.element_formats("bf16"))
         for i in range(layers)], name="group-dense")
