"""Model plans as the daemon's wire messages (proto/memra/kv/v1/model_plan.proto).

Enum values are the core's plus one (0 is "unspecified" and refused). These helpers build the
layer kinds the tests and engines use; any memra.kv.v1.ModelPlan message works too, and
Client.import_model turns a Hugging Face config.json into one.
"""

from ._proto import model_plan_pb2 as pb

ModelPlan = pb.ModelPlan
LayerPlan = pb.LayerPlan
KvFormats = pb.KvFormats

# K and V formats storing one `element` per value (docs/rules.md#formats), by name.
_ELEMENT_FORMATS = {
    "bf16": (pb.K_FORMAT_BF16, pb.V_FORMAT_BF16, pb.ELEMENT_FORMAT_BF16),
    "f16": (pb.K_FORMAT_F16, pb.V_FORMAT_F16, pb.ELEMENT_FORMAT_F16),
    "f32": (pb.K_FORMAT_F32, pb.V_FORMAT_F32, pb.ELEMENT_FORMAT_F32),
    "fp8_e4m3": (pb.K_FORMAT_FP8_E4M3, pb.V_FORMAT_FP8_E4M3, pb.ELEMENT_FORMAT_FP8_E4M3),
    "fp8_e5m2": (pb.K_FORMAT_FP8_E5M2, pb.V_FORMAT_FP8_E5M2, pb.ELEMENT_FORMAT_FP8_E5M2),
}


def element_formats(name):
    """KvFormats storing K and V in element format `name` (bf16, f16, f32, fp8_e4m3,
    fp8_e5m2)."""
    k, v, _ = _ELEMENT_FORMATS[name]
    return pb.KvFormats(k=k, v=v)


def in_element_format(plan, name):
    """A copy of `plan` with every K/V layer and latent row in element format `name`: how an
    engine keeping its cache in the model dtype plans (import-model does this from torch_dtype)."""
    out = pb.ModelPlan()
    out.CopyFrom(plan)
    _, _, element = _ELEMENT_FORMATS[name]
    for layer in list(out.layers) + list(out.mtp_blocks):
        if layer.kind in (pb.STATE_KIND_KV, pb.STATE_KIND_SLIDING_KV):
            layer.formats.CopyFrom(element_formats(name))
        elif layer.kind == pb.STATE_KIND_LATENT:
            layer.latent_format = element
    return out


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


def latent_layer(index, latent_width, index_width=0, index_pool=0,
                 latent_format=pb.ELEMENT_FORMAT_UNSPECIFIED):
    """MLA latent rows of latent_width elements (f32 unless latent_format says otherwise);
    index_width > 0 adds a DSA indexer (f32; pool required)."""
    return pb.LayerPlan(index=index, kind=pb.STATE_KIND_LATENT, latent_width=latent_width,
                        index_width=index_width, index_pool=index_pool,
                        latent_format=latent_format)


def model_plan(layers, name="", mtp_blocks=(), swa_ring=False, index_ring_rows=None):
    plan = pb.ModelPlan(name=name, layers=list(layers), mtp_blocks=list(mtp_blocks),
                        swa_ring=swa_ring)
    if index_ring_rows is not None:
        plan.index_ring_rows = index_ring_rows
    return plan
