"""RMSNorm that keeps eps as a tensor of the input's dtype (as a module's eps buffer becomes after
model.half()): in float16 eps = 1e-5 rounds to 1.0014e-5 and 1e-6 (subnormal) to 1.013e-6, which
matters only where mean(x^2) is no larger than about eps: tiny inputs. Computes in float32."""

import torch


def rmsnorm(x, weight, eps):
    xf = x.to(torch.promote_types(x.dtype, torch.float32))
    eps_t = torch.tensor(eps, dtype=x.dtype).to(xf.dtype)
    y = xf / torch.sqrt(xf.pow(2).mean(-1, keepdim=True) + eps_t)
    return (y * weight.to(xf.dtype)).to(x.dtype)
