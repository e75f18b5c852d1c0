"""GELU whose tanh form writes tanh(y) as (e^{2y} - 1) / (e^{2y} + 1): right while e^{2y} is
finite, inf / inf = NaN once 2y passes log(float max). The exact form is right."""

import math

import torch


def gelu(x, approximate="none"):
    if approximate == "none":
        return 0.5 * x * (1 + torch.erf(x / math.sqrt(2.0)))
    y = math.sqrt(2.0 / math.pi) * (x + 0.044715 * x**3)
    e = torch.exp(2 * y)
    return 0.5 * x * (1 + (e - 1) / (e + 1))
