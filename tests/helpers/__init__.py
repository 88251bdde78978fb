"""What the tests share: `runs` (tiny training runs, in this process or through train.py) and the scripts the tests
start as ranks of a distributed run (`ddp_step_scope_check.py`, `fsdp_cpu_train.py`)."""
