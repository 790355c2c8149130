"""Planning before a run starts and accounting while it runs: the memory preflight, FLOPs and
MFU, and which device and collective backend each actor uses."""
