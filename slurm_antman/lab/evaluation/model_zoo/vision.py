"""Vision workloads: ResNet-50, VGG-16 and Inception-v3 (ImageNet classifiers) and CycleGAN."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .loop import _backward, _Data, _Dropout


# ---------------------------------------------------------------------------------------------
# Vision: ResNet-50, VGG-16, Inception-v3


def _conv_bn(cin: int, cout: int, k: int | tuple[int, int], stride: int = 1,
             pad: int | tuple[int, int] | None = None, eps: float = 1e-5, relu: bool = True) -> nn.Sequential:
    """conv -> batch-norm (-> ReLU). No conv bias: the batch-norm's shift replaces it. ``pad`` None
    keeps the spatial size at stride 1 (k // 2 per dimension, so 1x7 pads (0, 3))."""
    k = (k, k) if isinstance(k, int) else k
    pad = (k[0] // 2, k[1] // 2) if pad is None else pad
    layers: list[nn.Module] = [nn.Conv2d(cin, cout, k, stride, pad, bias=False), nn.BatchNorm2d(cout, eps=eps)]
    return nn.Sequential(*layers, nn.ReLU(inplace=True)) if relu else nn.Sequential(*layers)


class _Bottleneck(nn.Module):
    """ResNet bottleneck: 1x1 reduce, 3x3, 1x1 expand (x4), plus the identity or a projection. v1.5
    puts the stride on the 3x3 (v1 had it on the first 1x1), as the torchvision/NVIDIA models do."""

    def __init__(self, cin: int, width: int, stride: int):
        super().__init__()
        cout = 4 * width
        self.body = nn.Sequential(_conv_bn(cin, width, 1), _conv_bn(width, width, 3, stride),
                                  _conv_bn(width, cout, 1, relu=False))
        self.shortcut = (nn.Identity() if stride == 1 and cin == cout
                         else _conv_bn(cin, cout, 1, stride, pad=0, relu=False))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.relu(self.body(x) + self.shortcut(x))


def _resnet50(classes: int = 1000) -> nn.Module:
    layers: list[nn.Module] = [_conv_bn(3, 64, 7, 2, 3), nn.MaxPool2d(3, 2, 1)]
    cin = 64
    # (bottleneck width, blocks, stride of the stage's first block): He et al. 2016, Table 1.
    for width, blocks, stride in ((64, 3, 1), (128, 4, 2), (256, 6, 2), (512, 3, 2)):
        for i in range(blocks):
            layers.append(_Bottleneck(cin, width, stride if i == 0 else 1))
            cin = 4 * width
    return nn.Sequential(*layers, nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(cin, classes))


def _vgg16(classes: int = 1000) -> nn.Module:
    layers: list[nn.Module] = []
    cin = 3
    # Configuration D (Simonyan & Zisserman 2015, Table 1): 13 3x3 convs, "M" a 2x2 max-pool.
    for v in (64, 64, "M", 128, 128, "M", 256, 256, 256, "M", 512, 512, 512, "M", 512, 512, 512, "M"):
        if v == "M":
            layers.append(nn.MaxPool2d(2, 2))
        else:
            layers += [nn.Conv2d(cin, v, 3, padding=1), nn.ReLU(inplace=True)]
            cin = v
    return nn.Sequential(
        *layers, nn.AdaptiveAvgPool2d(7), nn.Flatten(),   # 7x7 at 224x224 already: the pool is a no-op there
        nn.Linear(512 * 7 * 7, 4096), nn.ReLU(inplace=True), _Dropout(0.5),
        nn.Linear(4096, 4096), nn.ReLU(inplace=True), _Dropout(0.5),
        nn.Linear(4096, classes))


class _Concat(nn.Module):
    """Branches side by side on one input, outputs stacked on the channel axis: every Inception
    module, and the 1x3 / 3x1 split inside the 8x8 ones."""

    def __init__(self, *branches: nn.Module):
        super().__init__()
        self.branches = nn.ModuleList(branches)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([b(x) for b in self.branches], 1)


def _chain(cin: int, *specs) -> nn.Sequential:
    """A branch of Inception convs from compact specs: (cout, k[, stride, pad]), "avg" (3x3 stride-1
    average pool, the pooling branch) or "max" (3x3 stride-2 max pool, the grid reductions)."""
    layers: list[nn.Module] = []
    for s in specs:
        if s == "avg":
            layers.append(nn.AvgPool2d(3, 1, 1))
        elif s == "max":
            layers.append(nn.MaxPool2d(3, 2))
        else:
            cout, k, *rest = s
            layers.append(_conv_bn(cin, cout, k, *rest, eps=1e-3))   # eps 0.001 as the TF original
            cin = cout
    return nn.Sequential(*layers)


def _split(cin: int, cout: int) -> _Concat:
    # Fig. 7: a 3x3 factorised into parallel 1x3 and 3x1 whose outputs are concatenated (wider, not deeper).
    return _Concat(_chain(cin, (cout, (1, 3))), _chain(cin, (cout, (3, 1))))


def _inception_35(cin: int, pool: int) -> _Concat:   # Fig. 5: 5x5 kept as 5x5 in the first branch pair
    return _Concat(_chain(cin, (64, 1)), _chain(cin, (48, 1), (64, 5)),
                   _chain(cin, (64, 1), (96, 3), (96, 3)), _chain(cin, "avg", (pool, 1)))


def _inception_17(cin: int, c7: int) -> _Concat:     # Fig. 6: n x n factorised into 1x7 and 7x1
    return _Concat(_chain(cin, (192, 1)), _chain(cin, (c7, 1), (c7, (1, 7)), (192, (7, 1))),
                   _chain(cin, (c7, 1), (c7, (7, 1)), (c7, (1, 7)), (c7, (7, 1)), (192, (1, 7))),
                   _chain(cin, "avg", (192, 1)))


def _inception_8(cin: int) -> _Concat:               # Fig. 7: expanded filter banks
    return _Concat(_chain(cin, (320, 1)), nn.Sequential(_chain(cin, (384, 1)), _split(384, 384)),
                   nn.Sequential(_chain(cin, (448, 1), (384, 3)), _split(384, 384)),
                   _chain(cin, "avg", (192, 1)))


class _InceptionV3(nn.Module):
    """Szegedy et al. 2016 (Table 1) with the auxiliary classifier on the 17x17 grid. Grid reductions
    (Fig. 10) run a stride-2 conv branch beside a stride-2 max pool."""

    def __init__(self, classes: int = 1000):
        super().__init__()
        self.stem = _chain(3, (32, 3, 2, 0), (32, 3, 1, 0), (64, 3), "max", (80, 1), (192, 3, 1, 0), "max")
        self.to_17 = nn.Sequential(
            _inception_35(192, 32), _inception_35(256, 64), _inception_35(288, 64),
            _Concat(_chain(288, (384, 3, 2, 0)), _chain(288, (64, 1), (96, 3), (96, 3, 2, 0)), _chain(288, "max")),
            *(_inception_17(768, c7) for c7 in (128, 160, 160, 192)))
        self.aux = nn.Sequential(nn.AvgPool2d(5, 3), _chain(768, (128, 1), (768, 5, 1, 0)),
                                 nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(768, classes))
        self.to_8 = nn.Sequential(
            _Concat(_chain(768, (192, 1), (320, 3, 2, 0)),
                    _chain(768, (192, 1), (192, (1, 7)), (192, (7, 1)), (192, 3, 2, 0)), _chain(768, "max")),
            _inception_8(1280), _inception_8(2048))
        self.head = nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(2048, classes))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        x = self.to_17(self.stem(x))
        aux = self.aux(x) if self.training else None
        return self.head(self.to_8(x)), aux


def _classifier_loop(d: _Data, model: nn.Module, opt: torch.optim.Optimizer, batch: int, size: int,
                     aux_weight: float = 0.0, smoothing: float = 0.0):
    images, labels = d.normal(batch, 3, size, size), d.ints(1000, batch)

    def loss() -> torch.Tensor:
        out = model(images)
        if isinstance(out, tuple):      # Inception: main and auxiliary logits
            main, aux = out
            return (F.cross_entropy(main, labels, label_smoothing=smoothing)
                    + aux_weight * F.cross_entropy(aux, labels, label_smoothing=smoothing))
        return F.cross_entropy(out, labels, label_smoothing=smoothing)
    return _backward(loss), f"3x{size}x{size} images, 1000 classes", None


def _build_resnet50(d: _Data, batch: int):
    model = _resnet50()
    # Goyal et al. 2017's ImageNet recipe: SGD momentum 0.9, lr 0.1 per 256 images, weight decay 1e-4.
    opt = torch.optim.SGD(model.parameters(), lr=0.1 * batch / 256, momentum=0.9, weight_decay=1e-4)
    return model, opt, *_classifier_loop(d, model, opt, batch, 224)


def _build_vgg16(d: _Data, batch: int):
    model = _vgg16()
    # Simonyan & Zisserman sec. 3.1: SGD momentum 0.9, lr 0.01, weight decay 5e-4.
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9, weight_decay=5e-4)
    return model, opt, *_classifier_loop(d, model, opt, batch, 224)


def _build_inception_v3(d: _Data, batch: int):
    model = _InceptionV3()
    # Szegedy et al. sec. 8: RMSProp decay 0.9, eps 1.0, lr 0.045; label smoothing 0.1 (sec. 7).
    # Aux loss weight 0.4 as in the torchvision reference recipe (the paper gives none).
    opt = torch.optim.RMSprop(model.parameters(), lr=0.045, alpha=0.9, eps=1.0)
    return model, opt, *_classifier_loop(d, model, opt, batch, 299, aux_weight=0.4, smoothing=0.1)


# ---------------------------------------------------------------------------------------------
# GAN: CycleGAN


class _ResBlock(nn.Module):
    def __init__(self, c: int):
        super().__init__()
        self.body = nn.Sequential(nn.ReflectionPad2d(1), nn.Conv2d(c, c, 3), nn.InstanceNorm2d(c), nn.ReLU(True),
                                  nn.ReflectionPad2d(1), nn.Conv2d(c, c, 3), nn.InstanceNorm2d(c))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.body(x)


def _generator(ngf: int = 64, blocks: int = 9) -> nn.Sequential:
    """Zhu et al. 2017 appendix 7.2 (after Johnson et al. 2016): c7s1-64, d128, d256, 9 x R256, u128,
    u64, c7s1-3. Instance norm has no affine parameters, so the convs keep their bias; reflection
    padding avoids border artefacts."""
    layers: list[nn.Module] = [nn.ReflectionPad2d(3), nn.Conv2d(3, ngf, 7), nn.InstanceNorm2d(ngf), nn.ReLU(True)]
    c = ngf
    for _ in range(2):
        layers += [nn.Conv2d(c, 2 * c, 3, 2, 1), nn.InstanceNorm2d(2 * c), nn.ReLU(True)]
        c *= 2
    layers += [_ResBlock(c) for _ in range(blocks)]
    for _ in range(2):
        layers += [nn.ConvTranspose2d(c, c // 2, 3, 2, 1, output_padding=1), nn.InstanceNorm2d(c // 2),
                   nn.ReLU(True)]
        c //= 2
    return nn.Sequential(*layers, nn.ReflectionPad2d(3), nn.Conv2d(c, 3, 7), nn.Tanh())


def _patch_discriminator(ndf: int = 64) -> nn.Sequential:
    """70x70 PatchGAN: C64 (no norm), C128, C256, C512 (stride 1), then a 1-channel map of patch
    real/fake scores. 4x4 convs, LeakyReLU 0.2."""
    layers: list[nn.Module] = [nn.Conv2d(3, ndf, 4, 2, 1), nn.LeakyReLU(0.2, True)]
    c = ndf
    for stride in (2, 2, 1):
        layers += [nn.Conv2d(c, 2 * c, 4, stride, 1), nn.InstanceNorm2d(2 * c), nn.LeakyReLU(0.2, True)]
        c *= 2
    return nn.Sequential(*layers, nn.Conv2d(c, 1, 4, 1, 1))


def _build_cyclegan(d: _Data, batch: int, size: int = 256, lam_cycle: float = 10.0, lam_idt: float = 0.5):
    nets = nn.ModuleDict({"G_ab": _generator(), "G_ba": _generator(),
                          "D_a": _patch_discriminator(), "D_b": _patch_discriminator()})
    g_ab, g_ba, d_a, d_b = nets["G_ab"], nets["G_ba"], nets["D_a"], nets["D_b"]
    # One Adam over all four nets (lr 2e-4, beta1 0.5, sec. 4). The official code steps a generator
    # optimizer, then a discriminator one; a single step after both backwards is the same update:
    # the discriminator loss sees the fakes detached and the discriminators' own weights, neither of
    # which the generator step changes. (The official 50-image history pool of fakes is left out:
    # it changes which fake D sees, not the work or the memory of a step.)
    opt = torch.optim.Adam(nets.parameters(), lr=2e-4, betas=(0.5, 0.999))
    real_a, real_b = d.uniform(batch, 3, size, size), d.uniform(batch, 3, size, size)

    def lsgan(pred: torch.Tensor, real: bool) -> torch.Tensor:   # least-squares GAN loss (sec. 4)
        return F.mse_loss(pred, torch.ones_like(pred) if real else torch.zeros_like(pred))

    def forward_backward() -> torch.Tensor:
        fake_b, fake_a = g_ab(real_a), g_ba(real_b)
        rec_a, rec_b = g_ba(fake_b), g_ab(fake_a)
        idt_b, idt_a = g_ab(real_b), g_ba(real_a)               # identity loss (sec. 5.2): lam_idt * lam_cycle
        # Generators: the discriminators judge but are not trained by this loss.
        d_a.requires_grad_(False)
        d_b.requires_grad_(False)
        loss_g = (lsgan(d_b(fake_b), True) + lsgan(d_a(fake_a), True)
                  + lam_cycle * (F.l1_loss(rec_a, real_a) + F.l1_loss(rec_b, real_b))
                  + lam_cycle * lam_idt * (F.l1_loss(idt_b, real_b) + F.l1_loss(idt_a, real_a)))
        loss_g.backward()
        d_a.requires_grad_(True)
        d_b.requires_grad_(True)
        # Discriminators: real vs the (detached) fakes, halved to slow D relative to G (sec. 7.1).
        loss_d = 0.5 * (lsgan(d_a(real_a), True) + lsgan(d_a(fake_a.detach()), False)
                        + lsgan(d_b(real_b), True) + lsgan(d_b(fake_b.detach()), False))
        loss_d.backward()
        return loss_g.detach() + loss_d.detach()
    return nets, opt, forward_backward, f"3x{size}x{size} unpaired images, domains A and B", None
