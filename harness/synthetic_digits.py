"""Built-in synthetic digits, so every step runs offline: when MNIST is neither on disk nor
downloadable, data.load_datasets falls back to these (with one warning line).

They are drawn like handwriting: a pen path per digit, bent, sheared, rotated and inked at a
random width, so a CNN learns them the way it learns MNIST (not instantly, not perfectly).
"""
import math

import torch


def _arc(cx, cy, rx, ry, start, stop, n):
    """n+1 points on an elliptical arc; angles in degrees, 0 = right, 90 = down."""
    angles = [math.radians(start + (stop - start) * i / n) for i in range(n + 1)]
    # Rounded so the table is the same whatever libm computed cos/sin.
    return [(round(cx + rx * math.cos(a), 4), round(cy + ry * math.sin(a), 4)) for a in angles]


# Pen paths of each digit: 1-2 polylines in a unit box (x to the right, y downwards).
DIGIT_STROKES = [
    [_arc(.5, .5, .3, .5, 0, 360, 12)],                                              # 0 ellipse
    [[(.3, .2), (.55, 0), (.55, 1)]],                                                # 1 flag + stem
    [_arc(.5, .28, .28, .28, 170, 400, 6) + [(.2, 1), (.82, 1)]],                    # 2 arc, diagonal, base
    [_arc(.47, .25, .26, .25, 200, 450, 6) + _arc(.47, .75, .3, .25, 270, 520, 6)],  # 3 two arcs
    [[(.62, 0), (.18, .66), (.85, .66)], [(.64, .35), (.64, 1)]],                    # 4
    [[(.78, 0), (.3, 0), (.26, .44)] + _arc(.5, .7, .3, .3, 235, 510, 7)],           # 5 bar, stem, bowl
    [[(.7, 0), (.38, .3)] + _arc(.5, .72, .26, .28, 200, -160, 9)],                  # 6 hook into a loop
    [[(.18, 0), (.82, 0), (.4, 1)]],                                                 # 7
    [_arc(.5, .24, .22, .24, 90, 450, 8), _arc(.5, .73, .27, .27, -90, 270, 8)],     # 8 two loops
    [_arc(.5, .3, .26, .3, 0, 360, 9) + [(.72, 1)]],                                 # 9 loop + tail
]


def _segment_distance(px, py, x0, y0, x1, y1):
    """Distance from points (px, py) to segments (x0, y0)-(x1, y1); all arguments broadcast."""
    ux, uy, ax, ay = x1 - x0, y1 - y0, px - x0, py - y0
    t = ((ax * ux + ay * uy) / (ux * ux + uy * uy).clamp_min(1e-9)).clamp(0, 1)  # nearest point
    return ((ax - t * ux) ** 2 + (ay - t * uy) ** 2).sqrt()


# DIGIT_FIELD[d, i, j]: distance from grid point (x_j, y_i) to the nearest stroke of digit d, on a
# G x G grid over [-0.5, 1.5]^2. Rendering then needs one bilinear lookup per pixel instead of a
# distance to every segment, which is ~10x faster.
G, LO, CELL = 64, -0.5, 2 / 63
_grid = LO + CELL * torch.arange(G)
DIGIT_FIELD = torch.stack([
    _segment_distance(_grid, _grid[:, None], *torch.tensor(
        [(*p, *q) for line in strokes for p, q in zip(line, line[1:])]).T[..., None, None]).amin(0)
    for strokes in DIGIT_STROKES]).flatten()


def synthetic_digits(count: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """MNIST-like stand-in: images uint8 [count, 28, 28] (white ink on black), labels int64 [count].

    Every pixel is mapped back into its digit's unit box through a random affine (shift, scale,
    shear, rotation) and a smooth quadratic bend, where the distance to the pen path is looked up
    and turned into ink; some samples also get a stray stroke. Work runs in fixed chunks, each with
    its own generator seeded from (seed, chunk index), so memory stays small and the first k
    samples of any call equal a call with count=k. Only rand/randint and + - * / sqrt are used (no
    randn, sin, exp, matmul: those differ between CPUs), so output is bit-identical everywhere.
    """
    chunk, images, labels = 250, [], []
    pix = torch.arange(28.0)  # pixel centres
    for c in range(0, count, chunk):
        g = torch.Generator().manual_seed(seed * 1_000_003 + c // chunk)
        def uniform(lo, hi, *shape):  # default shape [n, 1, 1]: one value per sample
            return lo + (hi - lo) * torch.rand(shape or (chunk, 1, 1), generator=g)
        y = torch.randint(0, 10, (chunk,), generator=g)
        # Pixel -> unit box: undo shift and scale (px per unit; x narrower so 1s stay thin) ...
        size = uniform(17, 22)
        x = (pix - uniform(11.5, 15.5)) / (size * uniform(.75, 1.05))  # [n, 1, 28] columns
        z = (pix[:, None] - uniform(11.5, 15.5)) / size                 # [n, 28, 1] rows
        # ... shear, bend (keeps strokes smooth and joined), and rotate by up to ~15 degrees,
        # with cos/sin built from t = tan(angle / 2) so no trig is needed.
        x = x + uniform(-.3, .3) * z
        x, z = x + uniform(-.4, .4) * z * z, z + uniform(-.4, .4) * x * x
        t = uniform(-.13, .13)
        cos, sin = (1 - t * t) / (1 + t * t), 2 * t / (1 + t * t)
        u, v = (cos * x - sin * z + .5 - LO) / CELL, (sin * x + cos * z + .5 - LO) / CELL  # [n, 28, 28]
        # Bilinear lookup in the distance field, converted to pixels.
        u, v = u.clamp(0, G - 1.001), v.clamp(0, G - 1.001)
        iu, iv = u.floor(), v.floor()
        fu, fv = u - iu, v - iv
        i = ((y[:, None, None] * G + iv) * G + iu).long()
        d00, d01, d10, d11 = (DIGIT_FIELD.take(i + o) for o in (0, 1, G, G + 1))
        dist = ((d00 + fu * (d01 - d00)) * (1 - fv) + (d10 + fu * (d11 - d10)) * fv) * size
        # In 30% of samples a short stray stroke; otherwise it is parked far off the canvas.
        stray = uniform(0, 1) < 0.3
        sx, sy = uniform(0, 28).where(stray, -1e3), uniform(0, 28).where(stray, -1e3)
        dist = dist.minimum(_segment_distance(pix, pix[:, None], sx, sy,
                                              sx + uniform(-8, 8), sy + uniform(-8, 8)))
        # Ink: full within the pen radius, fading linearly over `soft` pixels outside it,
        # plus faint background noise.
        radius, soft, bright = uniform(.6, 1.8), uniform(.8, 1.6), uniform(.7, 1)
        ink = ((radius - dist) / soft + 0.5).clamp(0, 1) * bright
        ink = (ink + uniform(0, .15, chunk, 28, 28) * uniform(0, 1)).clamp(0, 1)
        images.append((ink * 255).round().to(torch.uint8))
        labels.append(y)
    return torch.cat(images)[:count], torch.cat(labels)[:count]
