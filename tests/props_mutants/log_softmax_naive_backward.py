"""log_softmax with a hand-written backward that recomputes softmax as exp(x) / sum exp(x)
without the max shift. The forward is the stable x - m - log sum exp(x - m); the gradient
overflows to NaN once a logit passes log(float max) (88.7 in float32, 709.8 in float64)."""

import torch


class _LogSoftmax(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, dim):
        xf = x.to(torch.promote_types(x.dtype, torch.float32))
        m = xf.amax(dim, keepdim=True)
        out = xf - m - torch.log(torch.exp(xf - m).sum(dim, keepdim=True))
        ctx.save_for_backward(xf)
        ctx.dim = dim
        return out.to(x.dtype)

    @staticmethod
    def backward(ctx, g):
        (xf,) = ctx.saved_tensors
        e = torch.exp(xf)
        p = e / e.sum(ctx.dim, keepdim=True)
        gf = g.to(xf.dtype)
        return (gf - p * gf.sum(ctx.dim, keepdim=True)).to(g.dtype), None


def log_softmax(x, dim=-1):
    return _LogSoftmax.apply(x, dim)
