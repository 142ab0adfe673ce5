"""The benchmark models in Python, ported from remat's C++ ones (same shapes).

Each builder returns (blocks: nn.Sequential, x: input tensor) for the chain the
strategies wrap: a deep MLP of Linear+GELU blocks, the GPT block stack
(remat::models::GptBlock: pre-LN causal attention + GELU MLP, dropout 0) and
the blocks of a CIFAR-style ResNet-18 (basic blocks with BatchNorm).
Leaves out: embeddings, heads and losses (the chain ends in .sum()); weight
values match the C++ side only in distribution, not bitwise.
"""
import math

import torch
import torch.nn as nn
import torch.nn.functional as F

# Shapes shared with build() in bench/compare/remat_compare.cpp; change both together.
MLP = dict(blocks=24, width=256, batch=128)
GPT = dict(blocks=16, d_model=128, heads=4, seq_len=128, batch=1)
RESNET = dict(width=16, batch=4, image=32, stages=4)  # depth 18: stages of 2 basic blocks
# The reference sizes (`make bench`; remat_compare's mlp-ref, gpt-ref, resnet-ref).
MLP_REF = dict(blocks=24, width=1024, batch=2048)
GPT_REF = dict(blocks=8, d_model=512, heads=8, seq_len=512, batch=4)  # the CPU reference (docs/BENCHMARKS.md)
RESNET_REF = dict(width=32, batch=100, image=32, stages=3)  # 3 stages x 2 basic blocks


class MlpBlock(nn.Module):
    """Linear(width, width) + GELU: (B, width) -> (B, width)."""

    def __init__(self, width):
        super().__init__()
        self.lin = nn.Linear(width, width)

    def forward(self, x):
        return F.gelu(self.lin(x))


class CausalSelfAttention(nn.Module):
    """remat::models::CausalSelfAttention: (B, T, C) -> (B, T, C). sdpa: the
    attention core through F.scaled_dot_product_attention(is_causal=True)."""

    def __init__(self, d_model, heads, sdpa=False):
        super().__init__()
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.proj = nn.Linear(d_model, d_model)
        self.heads = heads
        self.sdpa = sdpa

    def forward(self, x):
        B, T, C = x.shape
        hd = C // self.heads
        qkv = self.qkv(x).view(B, T, 3, self.heads, hd).permute(2, 0, 3, 1, 4)  # (3, B, H, T, hd)
        q, k, v = qkv[0], qkv[1], qkv[2]
        if self.sdpa:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # (B, H, T, hd)
            return self.proj(y.transpose(1, 2).reshape(B, T, C))
        att = torch.matmul(q, k.transpose(-2, -1)) * (1.0 / math.sqrt(hd))  # (B, H, T, T)
        future = torch.ones(T, T, dtype=torch.bool, device=x.device).triu(1)
        att = att.masked_fill(future, float("-inf"))
        att = torch.softmax(att, -1)
        y = torch.matmul(att, v).transpose(1, 2).reshape(B, T, C)
        return self.proj(y)


class Mlp(nn.Module):
    """remat::models::Mlp: GELU MLP with 4x expansion."""

    def __init__(self, d_model):
        super().__init__()
        self.fc = nn.Linear(d_model, 4 * d_model)
        self.proj = nn.Linear(4 * d_model, d_model)

    def forward(self, x):
        return self.proj(F.gelu(self.fc(x)))


class GptBlock(nn.Module):
    """remat::models::GptBlock: x = x + attn(ln1(x)); x = x + mlp(ln2(x))."""

    def __init__(self, d_model, heads, sdpa=False):
        super().__init__()
        self.ln1 = nn.LayerNorm(d_model)
        self.ln2 = nn.LayerNorm(d_model)
        self.attn = CausalSelfAttention(d_model, heads, sdpa)
        self.mlp = Mlp(d_model)

    def forward(self, x):
        h = x + self.attn(self.ln1(x))
        return h + self.mlp(self.ln2(h))


class ConvBnRelu(nn.Module):
    def __init__(self, cin, cout, kernel, stride):
        super().__init__()
        self.conv = nn.Conv2d(cin, cout, kernel, stride=stride, padding=kernel // 2, bias=False)
        self.bn = nn.BatchNorm2d(cout)

    def forward(self, x):
        return F.relu(self.bn(self.conv(x)))


class ResBlock(nn.Module):
    """remat::models::ResBlock, basic variant: 3x3 conv-bn-relu, 3x3 conv-bn, shortcut, relu."""

    def __init__(self, cin, mid, stride):
        super().__init__()
        self.first = ConvBnRelu(cin, mid, 3, stride)
        self.conv2 = nn.Conv2d(mid, mid, 3, stride=1, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(mid)
        self.down = None
        if stride != 1 or cin != mid:
            self.down = nn.Sequential(nn.Conv2d(cin, mid, 1, stride=stride, bias=False), nn.BatchNorm2d(mid))

    def forward(self, x):
        h = self.bn2(self.conv2(self.first(x)))
        skip = self.down(x) if self.down is not None else x
        return F.relu(h + skip)


def build(name, seed=0):
    """(blocks, x) for 'mlp', 'gpt', 'resnet' or their reference sizes 'mlp-ref',
    'gpt-ref', 'resnet-ref'; x requires grad."""
    torch.manual_seed(seed)
    if name in ("mlp", "mlp-ref"):
        c = MLP if name == "mlp" else MLP_REF
        seq = nn.Sequential(*[MlpBlock(c["width"]) for _ in range(c["blocks"])])
        x = torch.randn(c["batch"], c["width"])
    elif name in ("gpt", "gpt-ref"):
        c = GPT if name == "gpt" else GPT_REF
        seq = nn.Sequential(*[GptBlock(c["d_model"], c["heads"]) for _ in range(c["blocks"])])
        x = torch.randn(c["batch"], c["seq_len"], c["d_model"])
    elif name in ("resnet", "resnet-ref"):
        c = RESNET if name == "resnet" else RESNET_REF
        blocks, cin = [], c["width"]
        for stage in range(c["stages"]):  # two basic blocks per stage (4 stages: ResNet-18)
            mid = c["width"] << stage
            for i in range(2):
                blocks.append(ResBlock(cin, mid, 2 if stage > 0 and i == 0 else 1))
                cin = mid
        seq = nn.Sequential(*blocks)
        x = torch.randn(c["batch"], c["width"], c["image"], c["image"])
    else:
        raise ValueError(f"unknown model {name!r}: use mlp, gpt, resnet, mlp-ref, gpt-ref or resnet-ref")
    return seq, x.requires_grad_(True)
