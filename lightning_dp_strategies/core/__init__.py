"""What the Trainer strategies and the Fabric strategies share; imports ``lightning.fabric`` only.

- :mod:`.options`: the option checks, the bucketed and ring options, how a bucket is reduced (``ReductionOptions``).
- :mod:`.agreement`: the ranks' agreement on model and options at setup.
- :mod:`.checkpoint_io`: atomic checkpoint files.
- :mod:`.checkpoint_files`: which checkpoint to resume from (complete files only, the newest first).
- :mod:`.elastic`: process groups that torchrun's restarts can make again.
- :mod:`.membership`: the survivors of a lost rank agree on who is left and form a group over themselves (no strategy
  uses it yet).
- :mod:`.frozen_heap`: the heap frozen out of the garbage collector's reach while a rank's heartbeat runs.
- :mod:`.failures`: a failure injector for tests: kill or hang a chosen rank at a chosen step.
- :mod:`.engine`: the collaborators a bucketed strategy holds (gradient sync, sharding, the non-finite guard, local
  SGD).
- :mod:`.local_sgd`: local SGD's option checks and the options the Trainer and Fabric strategies share.
- :mod:`.nonfinite`: the ``nonfinite_grads`` guard.
- :mod:`.module_state`: rank 0's parameters and buffers on every rank.
- :mod:`.launch`: the refusal of a launcher Jupyter cannot run.
- :mod:`.registry`: registering strategy names, and finding the strategy classes of a package.
- :mod:`.topology`: nodes and processes a node, and the reducer that layout calls for.
"""
