r"""The clipped Gaussian prototype release (FedTIP Eqs. (4), (5), (7)), used by FedTIP and
FedOGL alike, and its privacy budget from a maintained accountant (Google's
``dp-accounting``): docs/security.md, "Private prototypes".

Mechanism: the mean :math:`\mathbf{q}` of :math:`n` representations, each clipped to L2 norm
:math:`C`, plus :math:`\mathcal{N}(0, \sigma^2 \Delta_2^2 I)` with
:math:`\Delta_2 = 2C/n`, the exact L2 sensitivity of the mean under the paper's replace-one
adjacency at a fixed, public :math:`n` (Eq. 5). The noise is :math:`\sigma` times the
sensitivity, so each release is the Gaussian mechanism of noise multiplier :math:`\sigma`,
and a run's releases compose."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from fedlightning.errors import ConfigError

EPS = 1e-8
DEFAULT_DELTA = 1e-5
ADJACENCY = "replace-one (fixed class count n, public)"
ACCOUNTANT = "dp_accounting RdpAccountant, Gaussian event of noise multiplier sigma"


def clip_embeddings(h: Tensor, c_emb: float) -> Tensor:
    r"""Rows scaled to norm at most :math:`C_{emb}` (the premise of Eq. (5))."""
    norms = h.norm(dim=-1, keepdim=True).clamp(min=EPS)
    return h * (c_emb / norms).clamp(max=1.0)


def release_sensitivity(c_emb: float, n: int) -> float:
    r"""Eq. (5): :math:`\Delta_2 = 2 C_{emb} / n`, the replace-one L2 sensitivity of the mean
    of :math:`n` representations of norm at most :math:`C_{emb}`."""
    return 2.0 * c_emb / n


def private_prototype(
    h: Tensor, c_emb: float, sigma: float, generator: torch.Generator | None = None
) -> Tensor:
    r"""Eqs. (4), (5), (7): the mean of the clipped representations ``h`` :math:`(n, d)` plus
    :math:`\mathcal{N}(0, \sigma^2 \Delta_2^2 I)` with :math:`\Delta_2 = 2 C_{emb} / n`."""
    q = clip_embeddings(h, c_emb).mean(0)
    delta = release_sensitivity(c_emb, h.size(0))
    noise = torch.randn(q.shape, generator=generator, dtype=q.dtype)
    return q + sigma * delta * noise.to(q.device)


def epsilon(sigma: float, releases: int, delta: float = DEFAULT_DELTA) -> float:
    r""":math:`\varepsilon` at ``delta`` of ``releases`` compositions of the Gaussian mechanism
    with noise multiplier ``sigma`` (noise std over L2 sensitivity), by ``dp-accounting``'s
    RDP accountant; ``inf`` for ``sigma == 0``, ``0`` for no release."""
    if releases <= 0:
        return 0.0
    if sigma <= 0:
        return float("inf")
    import dp_accounting
    from dp_accounting.rdp import rdp_privacy_accountant

    accountant = rdp_privacy_accountant.RdpAccountant()
    accountant.compose(dp_accounting.GaussianDpEvent(float(sigma)), int(releases))
    return float(accountant.get_epsilon(float(delta)))


@dataclass(frozen=True)
class PrototypeRelease:
    """``algorithm.dp``: ``clip`` (:math:`C_{emb}`; ``None``: prototypes leave in the clear),
    ``sigma`` (noise multiplier) and ``delta`` (the budget's :math:`\\delta`)."""

    clip: float | None = None
    sigma: float = 0.0
    delta: float = DEFAULT_DELTA

    @property
    def on(self) -> bool:
        return self.clip is not None

    @classmethod
    def from_settings(cls, dp: Mapping[str, Any] | None, key: str = "algorithm.dp") -> Any:
        """Checked settings; one :class:`ConfigError` line naming the key otherwise."""
        dp = dict(dp or {})
        unknown = sorted(set(dp) - {"clip", "sigma", "delta"})
        if unknown:
            raise ConfigError(f"{key}.{unknown[0]}", "unknown key; expected clip, sigma, delta")
        clip, sigma = dp.get("clip"), float(dp.get("sigma") or 0.0)
        delta = float(dp.get("delta", DEFAULT_DELTA))
        if clip is not None and not float(clip) > 0:
            raise ConfigError(f"{key}.clip", f"must be > 0 or null, got {clip}")
        if sigma < 0:
            raise ConfigError(f"{key}.sigma", f"must be >= 0, got {sigma}")
        if sigma > 0 and clip is None:
            raise ConfigError(f"{key}.sigma", "needs algorithm.dp.clip (the noise scales with it)")
        if not 0 < delta < 1:
            raise ConfigError(f"{key}.delta", f"must lie in (0, 1), got {delta}")
        return cls(None if clip is None else float(clip), sigma, delta)

    def budget(self, releases: int) -> dict[str, Any]:
        """The summary's ``privacy`` entry for a run of ``releases`` prototype releases."""
        eps = epsilon(self.sigma, releases, self.delta) if self.on else float("inf")
        return {
            "release": "clipped Gaussian (Eq. 7)" if self.on else "none (prototypes in clear)",
            "clip": self.clip,
            "sigma": self.sigma,
            "delta": self.delta,
            "releases": int(releases),
            "epsilon": eps,
            "adjacency": ADJACENCY,
            "accountant": ACCOUNTANT,
        }
