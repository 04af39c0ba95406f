"""How much slower per GPU a data-parallel job runs when spread over nodes, and how its throughput
grows with its GPUs on one node: Pollux's measurements.

Source: Qiao et al., "Pollux: Co-adaptive Cluster Scheduling for Goodput-Optimized Deep Learning",
OSDI 2021, section 5.3 ("Simulator construction"). Its artifact is the ``osdi21-artifact`` branch of
github.com/petuum/adaptdl (not master, which has no simulator), read at commit
c793c7089bd307462686339d29707925c461f9a9: ``simulator/traces/<w>/placements.csv`` for w in bert,
cifar10, deepspeech2, imagenet, ncf, yolov3 (``sched/traces/`` holds byte-identical copies). Each
row is one placement, a string of per-node GPU counts ("4": one node x 4 GPUs, "1111": 4 nodes x 1),
at one local (per-GPU) batch size, with ``step_time`` (seconds per iteration, synchronisation
included: ``simulator/applications.py`` adds gradient-accumulation steps as step_time - sync_time) and
``sync_time``. The testbed (``benchmark/main.tf``) was AWS g4dn.12xlarge: 4 NVIDIA T4 per node.

Derivation (``locality_derive.py`` implements it; ``python -m slurm_antman.lab.evaluation.locality_derive
<adaptdl>/simulator/traces --check`` recomputes this table from the CSVs and compares):

- per-GPU throughput = local_bsz / step_time;
- placements with the same GPU and node counts ("13" and "22") are averaged, step time by step time,
  which is what Pollux's own simulator does for a placement it did not measure;
- the reference is the same job packed on one node, or, for more than 4 GPUs, one full 4-GPU node:
  Pollux measured nothing bigger on one node, and a full node is its fastest per-GPU rate with no
  network in the way. So a value is the per-GPU throughput lost to crossing nodes;
- at each local batch size measured for both placements, efficiency = reference step time / spread
  step time; the table keeps the **median over those batch sizes**, rounded to 3 digits. Efficiency
  rises with the local batch (more compute per gradient exchange), so one batch would pick a point on
  that curve for every model alike; the median is a typical batch of the range Pollux swept for that
  model, and is robust to the single noisy points some workloads have (yolov3's batch 6 step is slower
  than its batch 8).

What the numbers show, and what to keep in mind:

- the anomaly of two nodes: placements on 2 nodes with several GPUs a node are slower than the same
  GPUs on 3 or 4 nodes in every workload, for every job of 3 to 8 GPUs (BERT, 4 GPUs: 0.36 on
  "13"/"22", 0.57 on "1111"); their sync_time is 1.4-5x that of "1111" (median over batches, 2x for
  BERT). The artifact does not say why; it is what was measured, so it stays in the table;
- spreading can be faster: cifar10 on "111" beats "3" at local batches of 182 and more (1.07 at the
  median), presumably because GPUs sharing a node also share its CPUs and PCIe; imagenet has two
  entries just over 1 (1.01, 1.02);
- a check: "BERT 0.96 on one node x 4 against 0.63 on 4 nodes x 1" is the CSV's per-GPU
  throughput of "4" and "1111" relative to one GPU ("1") at local batch 12 (0.963 and 0.627). Relative
  to the packed node, as here, that is 0.651 at batch 12, and the median over batches 4-12 is 0.566;
- ``scalability.csv`` (6-16 nodes, same directories) is not used: its rows do not give the per-node
  split, and they disagree with placements.csv where both cover a job (BERT on 8 nodes x 1 runs 1.6x
  faster per GPU there than "44" here), so they were not taken under the same conditions;
- T4s on a 50 Gbps network with Pollux's batch sizes: faster GPUs spend relatively more time in the
  exchange, so for V100-class nodes these are optimistic.

One-node scaling (``ONE_NODE_SPEEDUP``, the simulator's per-profile scaling curve; same files, same
``locality_derive.py``): for the one-node placements "1" to "4", the speedup S(w) is the job's
throughput, local_bsz x w / step_time, over one GPU's at the same local batch size, i.e. w x one GPU's
step time / w GPUs' step time; the table keeps the median over the local batch sizes measured for both
placements, rounded to 3 digits, as above. S(1) = 1 by construction. What to keep in mind:

- this is weak scaling at a fixed local batch (the global batch grows with w), which is how Pollux
  measured; it says nothing of the statistical efficiency of the larger batch, which Pollux models
  apart and we do not;
- S is increasing in w for every workload, and sublinear at the median (S(4)/4: bert 0.95, imagenet
  0.93, cifar10 0.90, deepspeech2 0.89, yolov3 0.75, ncf 0.63), though single batches are superlinear
  (bert at batch 12 on "2": 2.005; imagenet's 3-GPU maximum is 3.04). The per-GPU efficiency S(w)/w
  is not monotone: cifar10 (0.874 on 3, 0.899 on 4), deepspeech2 (0.865, 0.891) and bert (0.948, 0.949)
  do better per GPU on 4 GPUs than on 3;
- for ncf the 1-GPU runs go to local batch 32768 but the 4-GPU ones to 8207 (every placement stops
  near a global batch of 32768), so each S(w) is a median over a different set of batches, the
  smaller ones for larger w;
- Pollux measured at most 4 GPUs on a node; ``speedup`` extrapolates beyond 4 by holding the per-GPU
  efficiency of 4 GPUs, S(4) / 4, constant: an assumption, not a measurement;
- the g4dn.12xlarge T4s exchange over PCIe, without NVLink: a V100 node with NVLink exchanges faster
  but also computes faster, and these numbers do not say which wins.
"""

from __future__ import annotations

import bisect

POLLUX_PAPER = "Qiao et al., Pollux, OSDI 2021, section 5.3"
POLLUX_REPO = "petuum/adaptdl"
POLLUX_BRANCH = "osdi21-artifact"
POLLUX_COMMIT = "c793c7089bd307462686339d29707925c461f9a9"
POLLUX_FILES = tuple(f"simulator/traces/{w}/placements.csv"
                     for w in ("bert", "cifar10", "deepspeech2", "imagenet", "ncf", "yolov3"))
POLLUX_GPUS_PER_NODE = 4

# {workload: {(gpus, nodes): per-GPU efficiency}}, as printed by locality_derive.py (do not edit by hand).
MEASURED: dict[str, dict[tuple[int, int], float]] = {
    "bert": {
        (2, 2): 0.509,
        (3, 2): 0.409, (3, 3): 0.612,
        (4, 2): 0.36, (4, 3): 0.579, (4, 4): 0.566,
        (5, 2): 0.344, (5, 3): 0.556, (5, 4): 0.532,
        (6, 2): 0.316, (6, 3): 0.517, (6, 4): 0.487,
        (7, 2): 0.313, (7, 3): 0.508, (7, 4): 0.486,
        (8, 2): 0.292, (8, 3): 0.48, (8, 4): 0.473,
        (9, 3): 0.49, (9, 4): 0.466,
        (10, 3): 0.483, (10, 4): 0.461,
        (11, 3): 0.482, (11, 4): 0.454,
        (12, 3): 0.489, (12, 4): 0.448,
        (13, 4): 0.442,
        (14, 4): 0.431,
        (15, 4): 0.446,
        (16, 4): 0.422,
    },
    "cifar10": {
        (2, 2): 0.979,
        (3, 2): 0.781, (3, 3): 1.073,
        (4, 2): 0.781, (4, 3): 0.887, (4, 4): 0.84,
        (5, 2): 0.695, (5, 3): 0.855, (5, 4): 0.86,
        (6, 2): 0.674, (6, 3): 0.826, (6, 4): 0.767,
        (7, 2): 0.707, (7, 3): 0.757, (7, 4): 0.768,
        (8, 2): 0.652, (8, 3): 0.783, (8, 4): 0.749,
        (9, 3): 0.739, (9, 4): 0.77,
        (10, 3): 0.723, (10, 4): 0.77,
        (11, 3): 0.783, (11, 4): 0.734,
        (12, 3): 0.753, (12, 4): 0.74,
        (13, 4): 0.739,
        (14, 4): 0.678,
        (15, 4): 0.709,
        (16, 4): 0.771,
    },
    "deepspeech2": {
        (2, 2): 0.917,
        (3, 2): 0.87, (3, 3): 0.971,
        (4, 2): 0.823, (4, 3): 0.952, (4, 4): 0.935,
        (5, 2): 0.754, (5, 3): 0.917, (5, 4): 0.931,
        (6, 2): 0.752, (6, 3): 0.874, (6, 4): 0.913,
        (7, 2): 0.718, (7, 3): 0.852, (7, 4): 0.857,
        (8, 2): 0.651, (8, 3): 0.763, (8, 4): 0.783,
        (9, 3): 0.847, (9, 4): 0.873,
        (10, 3): 0.834, (10, 4): 0.844,
        (11, 3): 0.782, (11, 4): 0.767,
        (12, 3): 0.675, (12, 4): 0.739,
        (13, 4): 0.719,
        (14, 4): 0.794,
        (15, 4): 0.679,
        (16, 4): 0.697,
    },
    "imagenet": {
        (2, 2): 0.913,
        (3, 2): 0.855, (3, 3): 0.983,
        (4, 2): 0.772, (4, 3): 1.01, (4, 4): 0.97,
        (5, 2): 0.69, (5, 3): 0.923, (5, 4): 1.024,
        (6, 2): 0.694, (6, 3): 0.856, (6, 4): 0.93,
        (7, 2): 0.665, (7, 3): 0.894, (7, 4): 0.903,
        (8, 2): 0.685, (8, 3): 0.839, (8, 4): 0.858,
        (9, 3): 0.871, (9, 4): 0.853,
        (10, 3): 0.875, (10, 4): 0.843,
        (11, 3): 0.782, (11, 4): 0.854,
        (12, 3): 0.788, (12, 4): 0.8,
        (13, 4): 0.805,
        (14, 4): 0.812,
        (15, 4): 0.767,
        (16, 4): 0.758,
    },
    "ncf": {
        (2, 2): 0.546,
        (3, 2): 0.485, (3, 3): 0.687,
        (4, 2): 0.466, (4, 3): 0.59, (4, 4): 0.609,
        (5, 2): 0.42, (5, 3): 0.612, (5, 4): 0.576,
        (6, 2): 0.417, (6, 3): 0.571, (6, 4): 0.552,
        (7, 2): 0.385, (7, 3): 0.526, (7, 4): 0.532,
        (8, 2): 0.361, (8, 3): 0.524, (8, 4): 0.521,
        (9, 3): 0.504, (9, 4): 0.509,
        (10, 3): 0.518, (10, 4): 0.492,
        (11, 3): 0.47, (11, 4): 0.483,
        (12, 3): 0.51, (12, 4): 0.471,
        (13, 4): 0.466,
        (14, 4): 0.47,
        (15, 4): 0.456,
        (16, 4): 0.437,
    },
    "yolov3": {
        (2, 2): 0.497,
        (3, 2): 0.427, (3, 3): 0.668,
        (4, 2): 0.456, (4, 3): 0.688, (4, 4): 0.721,
        (5, 2): 0.403, (5, 3): 0.618, (5, 4): 0.673,
        (6, 2): 0.371, (6, 3): 0.558, (6, 4): 0.605,
        (7, 2): 0.381, (7, 3): 0.518, (7, 4): 0.569,
        (8, 2): 0.366, (8, 3): 0.502, (8, 4): 0.528,
        (9, 3): 0.486, (9, 4): 0.53,
        (10, 3): 0.485, (10, 4): 0.496,
        (11, 3): 0.469, (11, 4): 0.482,
        (12, 3): 0.47, (12, 4): 0.478,
        (13, 4): 0.47,
        (14, 4): 0.454,
        (15, 4): 0.459,
        (16, 4): 0.436,
    },
}

# {workload: {gpus on one node: throughput over one GPU's}}, as printed by locality_derive.py (do not
# edit by hand).
ONE_NODE_SPEEDUP: dict[str, dict[int, float]] = {
    "bert": {1: 1.0, 2: 1.975, 3: 2.844, 4: 3.797},
    "cifar10": {1: 1.0, 2: 1.796, 3: 2.623, 4: 3.597},
    "deepspeech2": {1: 1.0, 2: 1.884, 3: 2.595, 4: 3.566},
    "imagenet": {1: 1.0, 2: 1.986, 3: 2.895, 4: 3.739},
    "ncf": {1: 1.0, 2: 1.522, 3: 2.081, 4: 2.5},
    "yolov3": {1: 1.0, 2: 1.885, 3: 2.492, 4: 3.012},
}


# Each of our profiles (workloads.ZOO) -> the Pollux workload whose measurements stand in for it.
# Where Pollux ran the same model it is exact; otherwise the nearest model family; where no family is
# near, the nearest gradient-to-compute ratio, measured in our profiles' own V100 numbers as
# parameters (M) / mini-batch ms: resnet50 0.20, bert_base_finetune 0.41, deepspeech2 0.058.
PROFILE_TO_POLLUX: dict[str, str] = {
    "resnet50": "imagenet",
    "vgg16": "imagenet",
    "inception_v3": "imagenet",
    "bert_base_finetune": "bert",
    "gpt2_small": "bert",
    "lstm_lm": "bert",
    "transformer_nmt": "bert",
    "deepspeech2": "deepspeech2",
    "rl_ppo_atari": "deepspeech2",
    "cyclegan": "imagenet",
}

PROFILE_REASON: dict[str, str] = {
    "resnet50": "exact: Pollux's imagenet job is ResNet-50 on ImageNet",
    "vgg16": "an ImageNet CNN like Pollux's ResNet-50; 5.4x its gradient, so ratio 0.28 vs 0.20: optimistic",
    "inception_v3": "an ImageNet CNN with ResNet-50's gradient size (27 M vs 26 M params), ratio 0.15 vs 0.20",
    "bert_base_finetune": "exact: Pollux's bert job fine-tunes bert-base-uncased on SQuAD",
    "gpt2_small": "a transformer with BERT-base's gradient size (124 M vs 110 M); longer steps (ratio 0.14) "
                  "make bert's figures pessimistic for it",
    "lstm_lm": "nothing close (no language-model RNN in Pollux); the most gradient per compute of our zoo "
               "(0.58), nearest bert's 0.41, not the compute-bound recurrent deepspeech2 (0.058)",
    "transformer_nmt": "a transformer, ratio 0.54, nearest bert's 0.41",
    "deepspeech2": "same model family: Pollux's deepspeech2 job (on VoxForge's CMU US speech, per its manifests)",
    "rl_ppo_atari": "nothing close (no RL in Pollux); its 1.7 M params over 139 ms (0.012) need little "
                    "exchange, so the least exchange-bound measured model, deepspeech2 (0.058)",
    "cyclegan": "nothing close (no GAN in Pollux); a CNN on images, ratio 0.125: 1.6x from imagenet's "
                "0.20, 2.2x from deepspeech2's 0.058",
}


def workloads() -> tuple[str, ...]:
    return tuple(MEASURED)


def efficiency(workload: str, gpus: int, nodes: int) -> float:
    """Per-GPU throughput of a ``gpus``-GPU job of Pollux's ``workload`` over ``nodes`` nodes, relative
    to the same job with no network between its GPUs (module docstring).

    1.0 on one node, whatever ``gpus`` (a node bigger than Pollux's counts as no network). Measured
    (gpus, nodes): the table's value. Otherwise: more GPUs than measured (16) take the largest measured
    job's row; within a row, linear in ``nodes`` between the measured points and (1 node, 1.0), e.g. 12
    GPUs on 2 nodes of 8 lies between 1.0 and the 3-node value; beyond the most nodes measured (4), the
    4-node value. That clamp is optimistic: Pollux measured no job over more than 4 nodes."""
    table = MEASURED.get(workload)
    if table is None:
        raise ValueError(f"unknown Pollux workload {workload!r}; known: {', '.join(MEASURED)}")
    if isinstance(gpus, bool) or isinstance(nodes, bool) or not isinstance(gpus, int) or not isinstance(nodes, int):
        raise ValueError(f"gpus and nodes must be integers, got {gpus!r} and {nodes!r}")
    if nodes < 1:
        raise ValueError(f"nodes must be >= 1, got {nodes}")
    if gpus < nodes:
        raise ValueError(f"{gpus} GPUs cannot span {nodes} nodes: a placement has at least one GPU a node")
    if nodes == 1:
        return 1.0
    rows = sorted({g for g, _ in table})
    g = rows[max(0, bisect.bisect_right(rows, gpus) - 1)]
    points = [(1, 1.0)] + sorted((n, e) for (gg, n), e in table.items() if gg == g)
    xs = [n for n, _ in points]
    if nodes in xs:
        return points[xs.index(nodes)][1]
    if nodes > xs[-1]:
        return points[-1][1]
    i = bisect.bisect_left(xs, nodes)
    (n0, e0), (n1, e1) = points[i - 1], points[i]
    return e0 + (e1 - e0) * (nodes - n0) / (n1 - n0)


def profile_efficiency(profile: str, gpus: int, nodes: int) -> float:
    """``efficiency`` for one of our workload profiles, through ``PROFILE_TO_POLLUX``."""
    if profile not in PROFILE_TO_POLLUX:
        raise ValueError(f"unknown profile {profile!r}; known: {', '.join(PROFILE_TO_POLLUX)}")
    return efficiency(PROFILE_TO_POLLUX[profile], gpus, nodes)


def speedup(workload: str, gpus: int) -> float:
    """Throughput of a ``gpus``-GPU job of Pollux's ``workload`` on one node over its throughput on one
    GPU (module docstring). Measured for 1 to 4 GPUs. Beyond 4 (our nodes hold 8) it is ``gpus x
    S(4) / 4``: the per-GPU efficiency of a full Pollux node, held constant. That is an assumption,
    a clamp, not a measurement: Pollux measured nothing larger on one node, so nothing says whether
    more GPUs on a node lose more per GPU (a bigger exchange) or not."""
    table = ONE_NODE_SPEEDUP.get(workload)
    if table is None:
        raise ValueError(f"unknown Pollux workload {workload!r}; known: {', '.join(ONE_NODE_SPEEDUP)}")
    if isinstance(gpus, bool) or not isinstance(gpus, int):
        raise ValueError(f"gpus must be an integer, got {gpus!r}")
    if gpus < 1:
        raise ValueError(f"gpus must be >= 1, got {gpus}")
    if gpus in table:
        return table[gpus]
    top = max(table)
    return gpus * table[top] / top


def profile_speedup(profile: str, gpus: int) -> float:
    """``speedup`` for one of our workload profiles, through ``PROFILE_TO_POLLUX``."""
    if profile not in PROFILE_TO_POLLUX:
        raise ValueError(f"unknown profile {profile!r}; known: {', '.join(PROFILE_TO_POLLUX)}")
    return speedup(PROFILE_TO_POLLUX[profile], gpus)
