"""Synthetic ImageFolder datasets made of real JPEGs, for tests and benchmarks.

The point is realistic *bytes*: decodable JPEGs whose sizes follow an ImageNet-like spread, so
that packing, caching and DataLoader benchmarks see plausible I/O. Content is cheap: a handful of
noise textures rendered once per seed, then cropped, flipped and colour-shifted per file. Each
file's size is steered to a target by choosing its dimensions from a bytes-per-pixel model that is
calibrated per (texture, quality) and corrected from every encode.
"""

from __future__ import annotations

import io
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path

import numpy as np
from PIL import Image

TEXTURE_SIZE = 768  # large enough for the biggest images (4 x 200 KB) without upscaling
HF_AMPLITUDES = (1.5, 4.0, 9.0, 18.0, 35.0, 65.0, 110.0)  # texture roughness, smooth -> noisy
QUALITIES = (75, 85, 92)
SIZE_SIGMA = 0.55  # log-normal spread of file sizes (ImageNet's is of this order)
SIZE_CLIP = (0.2, 4.0)  # file sizes stay within these multiples of the mean
NOMINAL_AREA = 500 * 375  # typical ImageNet image; texture roughness is picked to approach it
ASPECTS = (4 / 3, 4 / 3, 4 / 3, 3 / 4, 1.0, 3 / 2, 16 / 9)
TOLERANCE = 0.06  # re-encode when a file misses its target by more than this fraction
MAX_ENCODES = 4


def class_name(index: int) -> str:
    """ImageNet-style class directory name (a WordNet-id look-alike), e.g. 'n00000003'."""
    return f"n{index:08d}"


@lru_cache(maxsize=4)
def _textures(seed: int) -> tuple[np.ndarray, ...]:
    """Noise textures, one per roughness level: smooth colour field + gradient + fine noise."""
    rng = np.random.default_rng([seed, 0x7E47])
    n = TEXTURE_SIZE
    ramp = np.linspace(-1.0, 1.0, n, dtype=np.float32)
    textures = []
    for amplitude in HF_AMPLITUDES:
        # Low-frequency structure: a coarse random grid upsampled smoothly (cheap "blobs").
        coarse = rng.uniform(30, 225, size=(12, 12, 3)).astype(np.uint8)
        low = np.asarray(Image.fromarray(coarse).resize((n, n), Image.Resampling.BICUBIC),
                         dtype=np.float32)
        angle = rng.uniform(0, 2 * math.pi)
        gradient = 40.0 * (np.cos(angle) * ramp[None, :] + np.sin(angle) * ramp[:, None])
        noise = rng.normal(0.0, amplitude, size=(n, n, 3)).astype(np.float32)
        img = low + gradient[:, :, None] + noise
        textures.append(np.clip(img, 0, 255).astype(np.uint8))
    return tuple(textures)


def _encode(img: Image.Image, quality: int) -> bytes:
    buf = io.BytesIO()
    img.save(buf, "JPEG", quality=quality)
    return buf.getvalue()


@dataclass
class _SizeModel:
    """bytes ~= overhead + bpp[(texture, quality)] * pixels, learned as files are made."""

    overhead: float
    bpp: dict[tuple[int, int], float] = field(default_factory=dict)

    def pixels_for(self, key: tuple[int, int], target: float) -> float:
        return max(target - self.overhead, 64.0) / self.bpp[key]

    def observe(self, key: tuple[int, int], pixels: int, size: int) -> None:
        measured = max(size - self.overhead, 16.0) / pixels
        # Smoothed, so one odd crop does not throw off the next guesses.
        self.bpp[key] = 0.7 * self.bpp[key] + 0.3 * measured


def _calibrate(textures: tuple[np.ndarray, ...]) -> _SizeModel:
    """Measure the fixed JPEG overhead and each (texture, quality)'s bytes per pixel."""
    tiny = Image.fromarray(textures[0][:8, :8])
    overhead = float(min(len(_encode(tiny, q)) for q in QUALITIES))
    model = _SizeModel(overhead=overhead)
    for t, texture in enumerate(textures):
        patch = Image.fromarray(texture[100:356, 100:356])
        for q in QUALITIES:
            model.bpp[(t, q)] = (len(_encode(patch, q)) - overhead) / (256 * 256)
    return model


def _target_sizes(rng: np.random.Generator, n: int, mean_bytes: float) -> np.ndarray:
    """Log-normal file sizes clipped to [0.2, 4] x mean, rescaled so the mean is exact."""
    if n == 0:
        return np.zeros(0)
    raw = rng.lognormal(mean=0.0, sigma=SIZE_SIGMA, size=n)
    raw = np.clip(raw / raw.mean(), *SIZE_CLIP)
    return raw / raw.mean() * mean_bytes


def _pick_style(rng: np.random.Generator, model: _SizeModel, target: float) -> tuple[int, int]:
    """Choose the (texture, quality) whose bytes-per-pixel gives roughly ImageNet dimensions."""
    quality = int(rng.choice(QUALITIES))
    area = NOMINAL_AREA * float(rng.uniform(0.6, 1.4))
    wanted = max(target - model.overhead, 64.0) / area
    texture = min(range(len(HF_AMPLITUDES)),
                  key=lambda t: abs(math.log(model.bpp[(t, quality)] / wanted)))
    return texture, quality


def _render(texture: np.ndarray, rng: np.random.Generator, width: int, height: int,
            lut: list[int], transpose: int) -> Image.Image:
    """Crop (upscaling only if the texture is too small), colour-shift and flip/rotate."""
    n = texture.shape[0]
    cw, ch = min(width, n), min(height, n)
    x, y = int(rng.integers(0, n - cw + 1)), int(rng.integers(0, n - ch + 1))
    img = Image.fromarray(texture[y:y + ch, x:x + cw])
    if (cw, ch) != (width, height):
        img = img.resize((width, height), Image.Resampling.BILINEAR)
    img = img.point(lut)
    if transpose >= 0:
        img = img.transpose(Image.Transpose(transpose))
    return img


def _colour_lut(rng: np.random.Generator) -> list[int]:
    """Per-channel gain/offset table for Image.point: cheap variety between files."""
    x = np.arange(256, dtype=np.float32)
    channels = [np.clip(x * rng.uniform(0.75, 1.15) + rng.uniform(-25, 25), 0, 255)
                for _ in range(3)]
    return np.concatenate(channels).astype(np.uint8).tolist()


def _make_jpeg(rng: np.random.Generator, textures: tuple[np.ndarray, ...], model: _SizeModel,
               target: float) -> bytes:
    """One JPEG of about `target` bytes; re-encodes at corrected dimensions if far off."""
    key = _pick_style(rng, model, target)
    aspect = float(rng.choice(ASPECTS))
    lut = _colour_lut(rng)
    # Transposes keep statistics (so the size model holds) but vary the look; -1 = none.
    transpose = int(rng.integers(-1, 4))
    seed = int(rng.integers(2**63))  # same crop offsets on every retry
    pixels = model.pixels_for(key, target)
    best = b""
    for _ in range(MAX_ENCODES):
        width = max(8, round(math.sqrt(pixels * aspect)))
        height = max(8, round(pixels / width))
        img = _render(textures[key[0]], np.random.default_rng(seed), width, height, lut,
                      transpose)
        data = _encode(img, key[1])
        model.observe(key, width * height, len(data))
        if not best or abs(len(data) - target) < abs(len(best) - target):
            best = data
        if abs(len(data) / target - 1) <= TOLERANCE:
            break
        # Scale the image area by how far the payload (beyond fixed overhead) missed.
        payload = max(len(data) - model.overhead, 16.0)
        pixels = width * height * max(target - model.overhead, 64.0) / payload
    return best


def make_imagefolder(root: Path, *, classes: int, per_class: int, mean_kb: float = 110.0,
                     seed: int = 0, split: str | None = "train",
                     progress: Callable[[int, int], None] | None = None) -> list[Path]:
    """Write `root/<split>/<class>/<class>_<i>.JPEG`, deterministically from `seed`.

    Sizes are log-normal around `mean_kb` (KiB), between ~0.2x and ~4x the mean.
    Returns the files written, sorted.
    """
    if classes < 0 or per_class < 0:
        raise ValueError("classes and per_class must be >= 0")
    if mean_kb <= 0:
        raise ValueError("mean_kb must be > 0")
    total = classes * per_class
    rng = np.random.default_rng([seed, 0xDA7A])
    textures = _textures(seed)
    model = _calibrate(textures)
    targets = _target_sizes(rng, total, mean_kb * 1024)
    base = Path(root) / split if split else Path(root)
    written: list[Path] = []
    for c in range(classes):
        directory = base / class_name(c)
        directory.mkdir(parents=True, exist_ok=True)
        for i in range(per_class):
            path = directory / f"{class_name(c)}_{i}.JPEG"
            path.write_bytes(_make_jpeg(rng, textures, model, float(targets[len(written)])))
            written.append(path)
            if progress is not None:
                progress(len(written), total)
    return sorted(written)


def make_tiny_members(root: Path, n_files: int, n_dirs: int, *, size: int = 0) -> list[Path]:
    """Write `n_files` files of `size` bytes round-robin over `n_dirs` directories, quickly.

    For metadata-scale tests (many members, little data). Returns the files, sorted.
    """
    if n_dirs < 1 and n_files > 0:
        raise ValueError("n_dirs must be >= 1 when n_files > 0")
    root = Path(root)
    dirs = [root / f"d{j:05d}" for j in range(n_dirs)]
    for d in dirs:
        d.mkdir(parents=True, exist_ok=True)
    payload = bytes(i % 251 for i in range(size))
    written = []
    for i in range(n_files):
        path = dirs[i % n_dirs] / f"f{i:08d}.bin"
        with open(path, "wb") as f:
            f.write(payload)
        written.append(path)
    return sorted(written)
