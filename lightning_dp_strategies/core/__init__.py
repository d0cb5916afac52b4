"""What the Trainer strategies and the Fabric strategies share; imports ``lightning.fabric`` only.

- :mod:`.options`: the option checks, the bucketed and ring options, how a bucket is reduced (``ReductionOptions``).
- :mod:`.agreement`: the ranks' agreement on model and options at setup.
- :mod:`.checkpoint_io`: atomic checkpoint files.
- :mod:`.checkpoint_files`: which checkpoint to resume from (complete files only, the newest first).
- :mod:`.elastic`: process groups that torchrun's restarts can make again.
- :mod:`.nonfinite`: the ``nonfinite_grads`` guard.
- :mod:`.module_state`: rank 0's parameters and buffers on every rank.
- :mod:`.launch`: the refusal of a launcher Jupyter cannot run.
- :mod:`.registry`: registering strategy names, and finding the strategy classes of a package.
- :mod:`.topology`: nodes and processes a node, and the reducer that layout calls for.
"""
