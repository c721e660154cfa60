"""What several chapters share, under public names; a topic module imports from here, not sideways.

models, datasets, training (the DDP step), timing (clocks that wait for the device), numerics
(tolerances from the dtype and the length of the sums), replicas (comparing replicas' weights),
sharded and memory (sharded models, their bytes, their collectives), checkpoint_files (atomic
writes, loading, RNG state), distributed (process-group setup for scripts), subprocesses
(starting torchrun and other programs, reading what each rank printed).
"""
