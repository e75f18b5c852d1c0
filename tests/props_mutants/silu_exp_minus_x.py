"""silu(x) = x / (1 + e^-x): the value is right at every finite x (x / inf = -0 below -88.7 in
float32), but its autograd derivative, 1/(1 + e) + x e/(1 + e)^2 with e = e^-x, is inf/inf = NaN
once e^-x overflows (x below -88.7 in float32, -709.8 in float64)."""

import torch


def silu(x):
    return x / (1 + torch.exp(-x))
