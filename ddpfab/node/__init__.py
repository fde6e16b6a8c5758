"""The one stdlib-only program ddpfab runs on nodes, module by module: its request loop and the
workdir's operations (``loop``, ``workdir``, ``treehash``), GPU leases, resources, the job
supervisor (``agent``), stacks and the other operations (``ops``), concatenated and shipped by
:mod:`ddpfab.remote.nodeprogram`; and the ranks' exit guard (``exitguard``). Nothing here imports
the rest of ddpfab: it runs on the nodes' own python (3.6 and later)."""
