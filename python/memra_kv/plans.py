"""Model plans as the daemon's wire messages (proto/memra/kv/v1/model_plan.proto).

Enum values are the core's plus one (0 is "unspecified" and refused). These helpers build the
layer kinds the tests and engines use; any memra.kv.v1.ModelPlan message works too, and
Client.import_model turns a Hugging Face config.json into one. Plans and layers are protobuf
messages (typed Any here: the generated stubs carry no type information).
"""

from typing import Any, Iterable, Optional

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


def element_formats(name: str) -> Any:
    """KvFormats storing K and V in element format `name` (bf16, f16, f32, fp8_e4m3,
    fp8_e5m2)."""
    k, v, _ = _ELEMENT_FORMATS[name]
    return pb.KvFormats(k=k, v=v)


def in_element_format(plan: Any, name: str) -> Any:
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


def kv_layer(index: int, head_dim: int, n_head_kv: int,
             attention: int = pb.ATTENTION_CLASS_ORDINARY, formats: Any = None) -> Any:
    """Full attention: head_dim x n_head_kv K/V elements a token (a LayerPlan); formats: a
    KvFormats (element_formats(name)), None: the daemon's default."""
    layer = pb.LayerPlan(index=index, kind=pb.STATE_KIND_KV, attention=attention,
                         head_dim_k=head_dim, head_dim_v=head_dim, n_head_kv=n_head_kv)
    if formats is not None:
        layer.formats.CopyFrom(formats)
    return layer


def sliding_layer(index: int, head_dim: int, n_head_kv: int, window: int,
                  attention: int = pb.ATTENTION_CLASS_ORDINARY) -> Any:
    """Sliding-window attention over `window` tokens (a ring when the plan has swa_ring)."""
    layer = kv_layer(index, head_dim, n_head_kv, attention)
    layer.kind = pb.STATE_KIND_SLIDING_KV
    layer.window = window
    return layer


def recurrent_layer(index: int, conv_width: int, conv_kernel: int, state_width: int) -> Any:
    """Linear attention: conv_width x (conv_kernel - 1) f32 conv state, state_width f32 SSM."""
    return pb.LayerPlan(index=index, kind=pb.STATE_KIND_RECURRENT, conv_width=conv_width,
                        conv_kernel=conv_kernel, state_width=state_width)


def latent_layer(index: int, latent_width: int, index_width: int = 0, index_pool: int = 0,
                 latent_format: int = pb.ELEMENT_FORMAT_UNSPECIFIED) -> Any:
    """MLA latent rows of latent_width elements (f32 unless latent_format says otherwise);
    index_width > 0 adds a DSA indexer (f32; pool required)."""
    return pb.LayerPlan(index=index, kind=pb.STATE_KIND_LATENT, latent_width=latent_width,
                        index_width=index_width, index_pool=index_pool,
                        latent_format=latent_format)


def model_plan(layers: Iterable[Any], name: str = "", mtp_blocks: Iterable[Any] = (),
               swa_ring: bool = False, index_ring_rows: Optional[int] = None) -> Any:
    """A ModelPlan of these LayerPlans (and MTP blocks). swa_ring: sliding layers hold their
    window in a ring when the capacity is large enough to save rows (docs/rules.md#swa-ring);
    index_ring_rows: the DSA indexer's working rows (None: the default). Register it with
    Client.register_plan to get the fingerprint sessions name."""
    plan = pb.ModelPlan(name=name, layers=list(layers), mtp_blocks=list(mtp_blocks),
                        swa_ring=swa_ring)
    if index_ring_rows is not None:
        plan.index_ring_rows = index_ring_rows
    return plan
