"""The incident's three hosts (../shared/BACKGROUND.md) as `kiln export` flags, for the tests that replay it.

The incident's GB10 workers took 2048 MiB of host memory and a 2048 MiB CUDA context out of the same pool; CPU
hosts stand in for them with the 4096 MiB as host memory (a CPU export reserves no device memory). host-1 and
host-2 get the incident's figures (250 and 349 MiB short of one compile worker); host-0 20480 MiB, room for two
workers (it "had memory" in the incident; its real reading would let whatever else runs decide).
"""

INCIDENT = ["--hosts", "3", "--tp", "3",
            "--set", "headroom_floor_mib=8192", "--set", "recipe_headroom_mib=1024",
            "--set", "worker_host_mib=4096", "--set", "unified_memory=true",
            "--assume-available", "host-0=20480",
            "--assume-available", "host-1=12038", "--assume-available", "host-2=11939"]
