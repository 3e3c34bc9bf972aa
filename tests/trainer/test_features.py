"""HF-forward features in a training process: the heap stays the size of what is kept.

A training process keeps every block on the heap (``cpu_malloc.keep_every_block_on_heap``). Computing
features batch after batch keeps each batch's hidden states while its logits, of a size that changes
with the batch's length, pass; on the heap those logits fragmented it, and the process grew by about a
batch's transients each batch. ``sequence_features`` maps such blocks again while it runs.

Engines: none; one fresh interpreter (malloc settings are process state), the tiny target through
transformers.
"""

from helpers import GLIBC_MALLINFO, run_probe
from vllm_specrl.cpu import malloc as cpu_malloc

PROBE = GLIBC_MALLINFO + r"""
import json, sys
import torch
from transformers import AutoModelForCausalLM
from vllm_specrl.cpu import malloc as cpu_malloc
from vllm_specrl.trainer.features import sequence_features

heap = cpu_malloc.keep_every_block_on_heap()
model = AutoModelForCausalLM.from_pretrained(sys.argv[1], dtype=torch.float32)
g = torch.Generator().manual_seed(0)
# 8 x 300-500 tokens x the tiny model's 4096-token vocabulary: 40-65 MiB of float32 logits a batch,
# above glibc's mmap ceiling, each batch a different size.
seqs = [torch.randint(0, 4096, (int(n),), generator=g).tolist() for n in torch.randint(300, 500, (320,), generator=g)]

def rss():
    return int(open("/proc/self/status").read().split("VmRSS:")[1].split()[0]) << 10

def size(items):
    return sum(t.numel() * t.element_size() for x in items for t in x.values() if torch.is_tensor(t))

kept = sequence_features(model, seqs[:16], [0, 1, 2])
first = rss()
more = sequence_features(model, seqs[16:], [0, 1, 2])
grown = rss() - first
mapped = libc.mallinfo2().hblkhd
block = libc.malloc(64 << 20)
print(json.dumps({"heap": heap, "extra_mib": (grown - size(more)) / 2**20,
                  "mapped_after_mib": (libc.mallinfo2().hblkhd - mapped) / 2**20}))
"""


def test_features_leave_the_heap_the_size_of_what_they_keep(tiny_model):
    got = run_probe(PROBE, str(tiny_model), timeout=300)
    assert got["heap"] == cpu_malloc.HEAP_INSTALLED, got
    # Kept: ~120 MiB of hidden states for 304 sequences; beyond them only the allocator's and torch's own
    # caches, while a fragmenting heap adds a part of each of the 38 batches' 40-65 MiB of logits.
    assert got["extra_mib"] < 150, got
    assert got["mapped_after_mib"] == 0, got   # the training process's heap mode is back afterwards
