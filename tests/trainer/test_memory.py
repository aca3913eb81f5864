"""``release_free_memory`` really gives freed tensor memory back to the operating system."""

from __future__ import annotations

import subprocess
import sys
import textwrap

# In a fresh interpreter, so that the heap's state is this script's alone: raise glibc's mmap
# threshold the way a training step does (free one large block), then allocate 1 MiB tensors
# between small ones that stay alive, free the large ones and read the resident set.
SCRIPT = textwrap.dedent(
    """
    import torch
    from trainer.models.memory import release_free_memory

    def rss_mib():
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * 4096 / 2**20

    block = torch.ones(8 << 20, dtype=torch.uint8)
    del block  # a freed mmapped block: glibc's threshold goes up to its 8 MiB
    big, small = [], []
    for _ in range(300):
        big.append(torch.ones(1 << 20, dtype=torch.uint8))
        small.append(torch.ones(64, dtype=torch.uint8))  # pins the heap between the big ones
    del big
    before = rss_mib()
    released = release_free_memory()
    print(released, round(before), round(rss_mib()))
    """
)


def test_freed_tensors_leave_the_process() -> None:
    out = subprocess.run(
        [sys.executable, "-c", SCRIPT], capture_output=True, text=True, check=True, timeout=120
    ).stdout.split()
    released, before, after = out[0] == "True", int(out[1]), int(out[2])
    assert released
    assert before - after > 200, (before, after)  # most of the 300 MiB freed goes back
