"""relu(x) = (x + |x|) / 2: exact wherever x + |x| = 2x is finite, inf above half the float max."""

import torch


def relu(x):
    return (x + x.abs()) / 2
