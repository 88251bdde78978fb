"""What the tests share: `runs` (tiny training runs, in this process or through train.py), `entry_points` (scripts
and the ranks of distributed runs forked from a server that imported the heavy libraries once: `fork_server.py`,
`forked.py`), `background` (slow work done in other processes while the tests run, such as `train_config.py`'s run)
and the scripts the tests start as ranks of a distributed run (`ddp_step_scope_check.py`, `fsdp_cpu_train.py`)."""
