"""PeakSampler: the tree's resident memory from /proc, and this process's own exact peak between samples."""

from __future__ import annotations

import subprocess
import sys
import time

import psutil

from kiln.host.processes.procs import PeakSampler, _tree_rss_psutil, tree_rss_bytes


def test_a_spike_between_samples_counts_for_this_process():
    with PeakSampler(interval_s=60.0) as sampler:  # no sample after the first one until the block ends
        spike = bytearray(256 * 2**20)  # touched: resident
        del spike
    assert sampler.peak_mib >= 256, sampler.peak_mib


def test_the_tree_counts_children_and_grandchildren():
    child = subprocess.Popen([sys.executable, "-c", "import subprocess, sys; b = bytearray(64 * 2**20); "
                              "subprocess.run([sys.executable, '-c', 'b = bytearray(64 * 2**20); input()'])"],
                             stdin=subprocess.PIPE)
    try:
        me = psutil.Process()
        for _ in range(200):  # both started and holding their 64 MiB
            kids = me.children(recursive=True)
            if len(kids) >= 2 and all(k.memory_info().rss > 64 * 2**20 for k in kids):
                break
            time.sleep(0.05)
        ours, walked = tree_rss_bytes(me), _tree_rss_psutil(me)
        assert ours >= me.memory_info().rss + 128 * 2**20
        assert abs(ours - walked) < 16 * 2**20, (ours, walked)
    finally:
        child.stdin.close()  # the grandchild's input() ends: it exits
        child.kill()
        child.wait()
