"""LayerNorm computed in the input dtype (no float32 upcast): right in float32 and float64; in
float16 the squares (x - mean)^2 overflow once the spread passes 256 (the variance is inf and every
output 0) and every op rounds to float16's 11 bits."""

import torch


def layer_norm(x, weight, bias, eps):
    c = x - x.mean(-1, keepdim=True)
    y = c / torch.sqrt(c.pow(2).mean(-1, keepdim=True) + eps) * weight
    return y + bias if bias is not None else y
