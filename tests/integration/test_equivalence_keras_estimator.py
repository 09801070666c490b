"""KerasEstimator trains the model plain Keras trains (issue 33): 2 ranks at batch b end with
the weights of one process at batch 2b (2b*bpps with backward_passes_per_step=bpps).

A ``transformation_fn`` records every batch each rank trains on; the k-th batches of the
ranks together are the plain run's k-th global batch. By default each rank trains at
lr * num_proc (Horovod's rule), which the plain run at batch 2b matches at lr * 2;
``scale_learning_rate=False`` trains at lr. With backward_passes_per_step=bpps the
update applies the MEAN of the bpps accumulated (rank-averaged) gradients, as the Torch
and Lightning Estimators do (the Estimator sets ``average_aggregated_gradients``; Horovod's
DistributedOptimizer alone sums): the plain run uses bpps times the batch.
Tolerances: ``equivalence_jobs``.
"""

from __future__ import annotations

import numpy as np
import pyspark  # noqa: F401 - CI installs it: never a skip
import pytest
import tensorflow  # noqa: F401 - CI installs it: never a skip

import hvd_spark.tensorflow as hvd
from hvd_spark.estimator import KerasEstimator
from tests.integration import equivalence_jobs as jobs

LR = jobs.LR
CASES = jobs.ESTIMATOR_CASES


@pytest.fixture(scope="module", params=list(CASES))
def fitted(request, equivalence_frame, tmp_path_factory) -> dict:
    """One KerasEstimator fit of a case: its initial and final weights, the batches the
    ranks trained on, and the plain run's final weights on them."""
    case = CASES[request.param]
    model = jobs.keras_model()
    init = [np.array(w) for w in model.get_weights()]  # the estimator ships this model
    recorded = tmp_path_factory.mktemp("batches")
    est = KerasEstimator(
        num_proc=jobs.N, model=model, optimizer=jobs.keras_optimizer(case["opt"], LR[case["opt"]]),
        loss=jobs.keras_loss(), feature_cols=["features"], label_cols=["label"],
        batch_size=jobs.BATCH, epochs=jobs.EPOCHS, shuffle=True, random_seed=7, verbose=0,
        use_gpu=False, backward_passes_per_step=case["bpps"],
        scale_learning_rate=case["scale"],
        gradient_compression=hvd.Compression.fp16 if case["fp16"] else None,
        transformation_fn=jobs.BatchRecorder(str(recorded)),
        store=str(tmp_path_factory.mktemp("store")))
    final = [np.asarray(w) for w in est.fit(equivalence_frame).getModel().get_weights()]
    steps = jobs.EPOCHS * jobs.ROWS // (jobs.N * jobs.BATCH)
    batches = jobs.recorded_global_batches(str(recorded), jobs.N, steps, "features", "label")
    lr = LR[case["opt"]] * (jobs.N if case["scale"] else 1)
    plain = jobs.keras_plain(init, case["opt"], lr, jobs.merge_steps(batches, case["bpps"]),
                             loss_scale=1.0)
    return {"name": request.param, "case": case, "batches": batches, "init": init,
            "plain": plain, "final": final}


def test_ranks_trained_on_every_row_each_epoch(fitted) -> None:
    x, _ = jobs.dataset()
    jobs.check_epochs_cover_dataset(fitted["batches"], jobs.EPOCHS, x)


def test_keras_estimator_matches_plain_keras(fitted) -> None:
    case, name = fitted["case"], fitted["name"]
    result = jobs.compare(fitted["final"], fitted["plain"], fitted["init"])
    print(f"KerasEstimator {name}: {result}")
    lr = LR[case["opt"]] * (jobs.N if case["scale"] else 1)
    result.check(jobs.tolerance(case["opt"], lr, case["fp16"]), f"KerasEstimator {name}")
