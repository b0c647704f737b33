"""Model plans as the daemon's wire messages (proto/memra/kv/v1/model_plan.proto).

Enum values are the core's plus one (0 is "unspecified" and refused). These helpers build the
layer kinds the tests and engines use; any memra.kv.v1.ModelPlan message works too, and
Client.import_model turns a Hugging Face config.json into one.
"""

from ._proto import model_plan_pb2 as pb

ModelPlan = pb.ModelPlan
LayerPlan = pb.LayerPlan
KvFormats = pb.KvFormats


def kv_layer(index, head_dim, n_head_kv, attention=pb.ATTENTION_CLASS_ORDINARY, formats=None):
    """Full attention: head_dim x n_head_kv K/V elements a token."""
    layer = pb.LayerPlan(index=index, kind=pb.STATE_KIND_KV, attention=attention,
                         head_dim_k=head_dim, head_dim_v=head_dim, n_head_kv=n_head_kv)
    if formats is not None:
        layer.formats.CopyFrom(formats)
    return layer


def sliding_layer(index, head_dim, n_head_kv, window, attention=pb.ATTENTION_CLASS_ORDINARY):
    """Sliding-window attention over `window` tokens (a ring when the plan has swa_ring)."""
    layer = kv_layer(index, head_dim, n_head_kv, attention)
    layer.kind = pb.STATE_KIND_SLIDING_KV
    layer.window = window
    return layer


def recurrent_layer(index, conv_width, conv_kernel, state_width):
    """Linear attention: conv_width x (conv_kernel - 1) f32 conv state, state_width f32 SSM."""
    return pb.LayerPlan(index=index, kind=pb.STATE_KIND_RECURRENT, conv_width=conv_width,
                        conv_kernel=conv_kernel, state_width=state_width)


def latent_layer(index, latent_width, index_width=0, index_pool=0):
    """MLA latent rows of latent_width f32; index_width > 0 adds a DSA indexer (pool required)."""
    return pb.LayerPlan(index=index, kind=pb.STATE_KIND_LATENT, latent_width=latent_width,
                        index_width=index_width, index_pool=index_pool)


def model_plan(layers, name="", mtp_blocks=(), swa_ring=False, index_ring_rows=None):
    plan = pb.ModelPlan(name=name, layers=list(layers), mtp_blocks=list(mtp_blocks),
                        swa_ring=swa_ring)
    if index_ring_rows is not None:
        plan.index_ring_rows = index_ring_rows
    return plan
