"""DiT: a class-conditional diffusion transformer on VAE latents (Peebles & Xie, "Scalable Diffusion Models with
Transformers", 2023); the defaults are DiT-XL/2 (28 blocks of 1152, 16 heads, 2x2 patches of a 32x32x4 latent,
a 256-pixel image; 675M parameters).

- Patchify: a convolution with stride ``patch`` (a linear map of each patch), plus fixed 2-D sine-cosine
  positions.
- Conditioning ``c``: a sinusoidal timestep embedding through an MLP, plus a class embedding (one extra row: the
  "no class" of classifier-free guidance, drawn with probability ``class_dropout`` in training).
- adaLN-Zero blocks: LayerNorms without parameters whose shift, scale and gate come from ``c`` through one
  Linear per block, initialized to zero, so that every block starts as the identity.
- The final layer (adaLN, then a Linear to ``patch * patch * 2 * channels``: the noise and the variance
  interpolation, "learned sigma"), unpatchified back to the latent's shape.

The loss is the paper's (improved DDPM's hybrid): the noise's mean squared error plus the variational bound on
the learned variance, the mean held fixed, over a linear schedule of 1000 steps.  The data draws the timesteps and
the noise (``example_inputs``), so that every layout trains on the same noised latents.  (At t = 0 the bound
keeps its KL term, where DiT scores a discretized decoder likelihood: one step in a thousand.)

Pipeline stages carry ``c`` with the tokens: a stage without the embedders takes ``[tokens; c]`` (one extra
row) and a stage without the final layer returns it, so the blocks of every stage are conditioned.  Blocks live
in a ``ModuleDict`` keyed by layer index, so that FQNs survive a pipeline split.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import cache

import torch
import torch.nn.functional as F
from autopar.models.config_checks import require_fraction, require_positive_ints
from torch import nn

#: The diffusion process DiT trains on: linear betas from 1e-4 to 0.02 over 1000 steps (DDPM's schedule).
DIFFUSION_STEPS = 1000
BETA_START, BETA_END = 1e-4, 0.02
#: Frequencies of the sinusoidal timestep embedding, and its largest period.
FREQUENCY_DIM, MAX_PERIOD = 256, 10000


@dataclass(kw_only=True)
class DiTConfig:
    layers: int = 28
    hidden: int = 1152
    heads: int = 16
    patch: int = 2
    image: int = 32  # the latent's side (a 256-pixel image through an 8x VAE)
    channels: int = 4
    classes: int = 1000
    mlp_ratio: int = 4
    class_dropout: float = 0.1
    seq_len: int | None = None  # the tokens, (image / patch)^2: set by image and patch, checked if given

    def __post_init__(self) -> None:
        require_positive_ints(self, "layers", "hidden", "heads", "patch", "image", "channels", "classes", "mlp_ratio")
        require_fraction(self, "class_dropout")
        if self.hidden % self.heads:
            raise ValueError(f"hidden ({self.hidden}) must be divisible by heads ({self.heads})")
        if self.image % self.patch:
            raise ValueError(f"image ({self.image}) must be divisible by patch ({self.patch})")
        if self.seq_len not in (None, self.grid ** 2):
            raise ValueError(f"seq_len is the tokens, (image / patch)^2 = {self.grid ** 2}, not {self.seq_len}: set "
                             "image and patch instead")
        self.seq_len = self.grid ** 2

    @property
    def grid(self) -> int:
        return self.image // self.patch


def sincos_positions(hidden: int, grid: int) -> torch.Tensor:
    """Fixed 2-D sine-cosine positions ``[grid * grid, hidden]``: half the channels encode the row, half the
    column, each as sines and cosines of geometric frequencies."""
    def one_axis(dim: int, pos: torch.Tensor) -> torch.Tensor:
        omega = 1.0 / MAX_PERIOD ** (torch.arange(dim // 2, dtype=torch.float64) / (dim / 2))
        angles = pos.reshape(-1, 1).double() * omega
        return torch.cat([angles.sin(), angles.cos()], dim=1)

    rows, cols = torch.meshgrid(torch.arange(grid), torch.arange(grid), indexing="ij")
    return torch.cat([one_axis(hidden // 2, rows), one_axis(hidden // 2, cols)], dim=1).float()


def timestep_frequencies(t: torch.Tensor, dim: int = FREQUENCY_DIM) -> torch.Tensor:
    """Sinusoidal features ``[b, dim]`` of the (integer) timesteps ``t``."""
    half = dim // 2
    freqs = torch.exp(-math.log(MAX_PERIOD) * torch.arange(half, dtype=torch.float32, device=t.device) / half)
    args = t.float()[:, None] * freqs[None]
    return torch.cat([torch.cos(args), torch.sin(args)], dim=-1)


def modulate(x: torch.Tensor, shift: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return x * (1 + scale.unsqueeze(1)) + shift.unsqueeze(1)


class TimestepEmbedder(nn.Module):
    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.fc1 = nn.Linear(FREQUENCY_DIM, hidden)
        self.fc2 = nn.Linear(hidden, hidden)

    def forward(self, t: torch.Tensor) -> torch.Tensor:
        features = timestep_frequencies(t).to(self.fc1.weight.dtype)
        return self.fc2(F.silu(self.fc1(features)))


class LabelEmbedder(nn.Module):
    """Class embeddings, with row ``classes`` for "no class" (classifier-free guidance's unconditional case)."""

    def __init__(self, classes: int, hidden: int, class_dropout: float) -> None:
        super().__init__()
        self.table = nn.Embedding(classes + 1, hidden)
        self.classes, self.class_dropout = classes, class_dropout

    def forward(self, y: torch.Tensor) -> torch.Tensor:
        if self.training and self.class_dropout > 0:
            drop = torch.rand(y.shape[0], device=y.device) < self.class_dropout
            y = torch.where(drop, torch.full_like(y, self.classes), y)
        return self.table(y)


class Attention(nn.Module):
    def __init__(self, cfg: DiTConfig) -> None:
        super().__init__()
        self.heads = cfg.heads
        self.q = nn.Linear(cfg.hidden, cfg.hidden)
        self.k = nn.Linear(cfg.hidden, cfg.hidden)
        self.v = nn.Linear(cfg.hidden, cfg.hidden)
        self.proj = nn.Linear(cfg.hidden, cfg.hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q, k, v = (lin(x).view(b, t, self.heads, -1).transpose(1, 2) for lin in (self.q, self.k, self.v))
        y = F.scaled_dot_product_attention(q, k, v)  # every patch attends to every other
        return self.proj(y.transpose(1, 2).reshape(b, t, -1))


class Block(nn.Module):
    """An adaLN-Zero block: attention and MLP on LayerNorms modulated by ``c``, each branch gated by it."""

    def __init__(self, cfg: DiTConfig) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(cfg.hidden, elementwise_affine=False, eps=1e-6)
        self.attn = Attention(cfg)
        self.norm2 = nn.LayerNorm(cfg.hidden, elementwise_affine=False, eps=1e-6)
        self.fc1 = nn.Linear(cfg.hidden, cfg.mlp_ratio * cfg.hidden)
        self.fc2 = nn.Linear(cfg.mlp_ratio * cfg.hidden, cfg.hidden)
        self.adaln = nn.Linear(cfg.hidden, 6 * cfg.hidden)

    def forward(self, x: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
        shift1, scale1, gate1, shift2, scale2, gate2 = self.adaln(F.silu(c)).chunk(6, dim=-1)
        x = x + gate1.unsqueeze(1) * self.attn(modulate(self.norm1(x), shift1, scale1))
        mlp = self.fc2(F.gelu(self.fc1(modulate(self.norm2(x), shift2, scale2)), approximate="tanh"))
        return x + gate2.unsqueeze(1) * mlp


class FinalLayer(nn.Module):
    def __init__(self, cfg: DiTConfig) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(cfg.hidden, elementwise_affine=False, eps=1e-6)
        self.adaln = nn.Linear(cfg.hidden, 2 * cfg.hidden)
        self.out = nn.Linear(cfg.hidden, cfg.patch * cfg.patch * 2 * cfg.channels)

    def forward(self, x: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
        shift, scale = self.adaln(F.silu(c)).chunk(2, dim=-1)
        return self.out(modulate(self.norm(x), shift, scale))


class DiT(nn.Module):
    def __init__(self, cfg: DiTConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.patchify = nn.Conv2d(cfg.channels, cfg.hidden, kernel_size=cfg.patch, stride=cfg.patch)
        self.t_embedder = TimestepEmbedder(cfg.hidden)
        self.y_embedder = LabelEmbedder(cfg.classes, cfg.hidden, cfg.class_dropout)
        self.blocks = nn.ModuleDict({str(i): Block(cfg) for i in range(cfg.layers)})
        self.final = FinalLayer(cfg)
        self.register_buffer("positions", sincos_positions(cfg.hidden, cfg.grid), persistent=False)
        self.init_weights()

    def init_weights(self) -> None:
        """Initialize every parameter (``init_parameter``)."""
        with torch.no_grad():
            for name, p in self.named_parameters():
                self.init_parameter(name, p)

    def init_parameter(self, name: str, p: torch.Tensor) -> None:
        """DiT's initialization: Xavier-uniform Linears (the patchify convolution as the Linear it is) with zero
        biases; normal(0, 0.02) for the class table and the timestep MLP; zeros for every adaLN modulation and
        the output Linear (adaLN-Zero: each block starts as the identity).  (autopar's runtime calls this per
        parameter.)"""
        if name.endswith("bias") or ".adaln." in name or name.startswith("final.out."):
            nn.init.zeros_(p)
        elif name.startswith(("y_embedder.", "t_embedder.")):
            nn.init.normal_(p, std=0.02)
        else:
            nn.init.xavier_uniform_(p.view(p.shape[0], -1))

    def forward(self, x: torch.Tensor, t: torch.Tensor, y: torch.Tensor, **_: torch.Tensor) -> torch.Tensor:
        """``x``: noised latents ``[b, channels, image, image]`` (a later pipeline stage: ``[tokens; c]`` from the
        stage before); ``t``: timesteps ``[b]``; ``y``: classes ``[b]``.  Returns the predicted noise and variance
        interpolation ``[b, 2 * channels, image, image]`` (an earlier stage: ``[tokens; c]``).  The loss's other
        inputs (the noise, the clean latents) pass by."""
        if self.patchify is not None:
            h = self.patchify(x).flatten(2).transpose(1, 2) + self.positions.to(x.dtype)
            c = self.t_embedder(t) + self.y_embedder(y)
        else:
            h, c = x[:, :-1], x[:, -1]
        for block in self.blocks.values():
            h = block(h, c)
        if self.final is None:
            return torch.cat([h, c.unsqueeze(1)], dim=1)
        return self.unpatchify(self.final(h, c))

    def unpatchify(self, x: torch.Tensor) -> torch.Tensor:
        """``[b, grid^2, patch^2 * C]`` -> ``[b, C, image, image]``."""
        g, p = self.cfg.grid, self.cfg.patch
        x = x.reshape(x.shape[0], g, g, p, p, -1)
        return torch.einsum("nhwpqc->nchpwq", x).reshape(x.shape[0], -1, g * p, g * p)


def build_model(**config) -> DiT:
    """Build a DiT from config keys ``layers, hidden, heads, patch, image, channels, classes, mlp_ratio,
    class_dropout`` (defaults: DiT-XL/2)."""
    return DiT(DiTConfig(**config))


@cache
def _schedule() -> dict[str, torch.Tensor]:
    """The linear schedule's per-step coefficients (float64, as improved DDPM computes them)."""
    betas = torch.linspace(BETA_START, BETA_END, DIFFUSION_STEPS, dtype=torch.float64)
    alphas_cumprod = torch.cumprod(1 - betas, dim=0)
    previous = torch.cat([torch.ones(1, dtype=torch.float64), alphas_cumprod[:-1]])
    posterior_variance = betas * (1 - previous) / (1 - alphas_cumprod)
    return {
        "sqrt_alphas_cumprod": alphas_cumprod.sqrt(),
        "sqrt_one_minus_alphas_cumprod": (1 - alphas_cumprod).sqrt(),
        "sqrt_recip_alphas_cumprod": (1 / alphas_cumprod).sqrt(),
        "sqrt_recipm1_alphas_cumprod": (1 / alphas_cumprod - 1).sqrt(),
        "log_betas": betas.log(),
        # the variance at t = 0 is zero: its log takes t = 1's value, as improved DDPM clips it
        "posterior_log_variance": torch.cat([posterior_variance[1:2], posterior_variance[1:]]).log(),
        "posterior_mean_x0": betas * previous.sqrt() / (1 - alphas_cumprod),
        "posterior_mean_xt": (1 - previous) * (1 - betas).sqrt() / (1 - alphas_cumprod),
    }


def _at(name: str, t: torch.Tensor) -> torch.Tensor:
    """The schedule's ``name`` at timesteps ``t``, shaped to broadcast over ``[b, C, H, W]`` (float32)."""
    return _schedule()[name].to(t.device)[t].float().view(-1, 1, 1, 1)


def example_inputs(batch_size: int, seq_len: int, image: int = 32, channels: int = 4, classes: int = 1000,
                   **config: object) -> dict[str, torch.Tensor]:
    """One step's data: clean latents, their classes, a timestep and noise per sample, and the noised latents
    the model sees, ``x_t = sqrt(a_t) x_0 + sqrt(1 - a_t) noise``."""
    x_start = torch.randn(batch_size, channels, image, image)
    t = torch.randint(0, DIFFUSION_STEPS, (batch_size,))
    noise = torch.randn_like(x_start)
    x = _at("sqrt_alphas_cumprod", t) * x_start + _at("sqrt_one_minus_alphas_cumprod", t) * noise
    return {"x": x, "t": t, "y": torch.randint(0, classes, (batch_size,)), "noise": noise, "x_start": x_start}


def loss_fn(output: torch.Tensor, x: torch.Tensor, t: torch.Tensor, y: torch.Tensor, noise: torch.Tensor,
            x_start: torch.Tensor) -> torch.Tensor:
    """The noise's mean squared error plus the variational bound (in bits per dimension) on the learned variance,
    through a mean held fixed, averaged over the batch."""
    eps, v = output.float().chunk(2, dim=1)
    mse = (noise - eps).pow(2).mean(dim=(1, 2, 3))
    frac = (v + 1) / 2  # the variance interpolates between the posterior's and beta's, in log space
    model_log_var = frac * _at("log_betas", t) + (1 - frac) * _at("posterior_log_variance", t)
    x0_hat = _at("sqrt_recip_alphas_cumprod", t) * x - _at("sqrt_recipm1_alphas_cumprod", t) * eps.detach()
    model_mean = _at("posterior_mean_x0", t) * x0_hat + _at("posterior_mean_xt", t) * x
    true_mean = _at("posterior_mean_x0", t) * x_start + _at("posterior_mean_xt", t) * x
    true_log_var = _at("posterior_log_variance", t)
    kl = 0.5 * (-1 + model_log_var - true_log_var + torch.exp(true_log_var - model_log_var)
                + (true_mean - model_mean).pow(2) * torch.exp(-model_log_var))
    vb = kl.mean(dim=(1, 2, 3)) / math.log(2.0)
    return (mse + vb).mean()
