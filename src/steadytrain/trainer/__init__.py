"""The `Trainer`: a run assembled from its parts and run to its end.

Its modules, each one concern (`fit` assembles the others):

- `fit`: the public `Trainer` and its `fit()`, the sequence in which a run is assembled and run.
- `program`: what the user's program gives the Trainer (`Program`), checked once when it is built.
- `data`: the program's data as read (`DataSource`), its order, and the batches drawn from it.
- `optimizers`: the run's optimizer and scheduler, built from what was given.
- `evaluation`: the evaluation set up from the config, `eval_data` and `eval_fn`.
- `notes`: what a run says at its start (notes, the arithmetic line, the BatchNorm warning).
- `parts`: the parts of one fit (`RunParts`), built in one go: device, model, step runner, ...
- `checkpointing`: the `Checkpointing` component, the run's checkpoint state, resume and writer.
- `passes`: the `Passes` component, the plan's trial passes and the resume probe.
- `callbacks`: the default callbacks every fit gets (the Trainer's and RunGuard's), in order.
- `changed_after_save`: the user_state a callback changes after the step's save, refused.
- `as_found`: what a start refused for bad input puts back (the lock, the folders it made).
- `result`: how a fit ends (`FitResult`, an already finished run, a Ctrl-C before the loop).

Importing the package loads none of them (the default callbacks are read by `RunGuard` in
programs that may run without torch); `Trainer`, `FitResult` and `BatchDependentModelWarning`
load on first use.
"""

from steadytrain._lazy import lazy_names

__getattr__, __dir__ = lazy_names(
    __name__,
    {
        "Trainer": "fit",
        "FitResult": "result",
        "BatchDependentModelWarning": "notes",
    },
)

__all__ = ["BatchDependentModelWarning", "FitResult", "Trainer"]
