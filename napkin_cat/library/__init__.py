"""Library diagrams: the computations the paper and its users care about, built from boxes.

Every diagram here is plain vocabulary (contractions, maps, reductions, softmax, masks) put
together with the :class:`~napkin_cat.ops.Builder` and :meth:`Diagram.weave`; nothing
downstream (relabeling, cost, lowering) knows these names.

>>> import napkin_cat as nc
>>> q, x, d = nc.axes("q x d")
>>> print(nc.library.attention(q=q, x=x, d=d))
Q[q d] f32, K[x d] f32, V[x d] f32 -> O[q d] f32
"""

from __future__ import annotations

from .basic import (attention, batched_matmul, layernorm, linear, matmul, mlp, multihead_attention,
                    normalized_attention, rmsnorm, softmax)
from .conv import conv, conv1d, conv2d
from .networks import batchnorm, resnet_block, transformer_block, unet, vit

__all__ = ["matmul", "batched_matmul", "linear", "mlp", "softmax", "layernorm", "rmsnorm",
           "attention", "multihead_attention", "normalized_attention", "conv", "conv1d", "conv2d",
           "batchnorm", "transformer_block", "resnet_block", "unet", "vit"]
