"""TorchEstimator trains the model plain torch trains (issue 33): 2 ranks at batch b end with
the weights of one process at batch 2b (2b*bpps with backward_passes_per_step=bpps).

A ``transformation_fn`` records every batch each rank trains on; the k-th batches of the
ranks together are the plain run's k-th global batch. By default each rank trains at
lr * num_proc (Horovod's rule), which the plain run at batch 2b matches at lr * 2;
``scale_learning_rate=False`` trains at lr. Tolerances: ``equivalence_jobs``.
"""

from __future__ import annotations

import copy

import pyspark  # noqa: F401 - CI installs it: never a skip
import pytest
import torch

import hvd_spark.torch as hvd
from hvd_spark.estimator import TorchEstimator
from tests.integration import equivalence_jobs as jobs

LR = jobs.LR
CASES = jobs.ESTIMATOR_CASES


@pytest.fixture(scope="module", params=list(CASES))
def fitted(request, equivalence_frame, tmp_path_factory) -> dict:
    """One TorchEstimator fit of a case: its initial and final weights, the batches the
    ranks trained on, and the plain run's final weights on them."""
    case = CASES[request.param]
    model = jobs.torch_model()
    initial = copy.deepcopy(model)  # the estimator ships the model it is given
    optimizer = jobs.torch_optimizer(case["opt"], model.parameters(), LR[case["opt"]])
    recorded = tmp_path_factory.mktemp("batches")
    est = TorchEstimator(
        num_proc=jobs.N, model=model, optimizer=optimizer, loss=torch.nn.CrossEntropyLoss(),
        feature_cols=["features"], label_cols=["label"], batch_size=jobs.BATCH,
        epochs=jobs.EPOCHS, shuffle=True, random_seed=7, verbose=0, use_gpu=False,
        backward_passes_per_step=case["bpps"], scale_learning_rate=case["scale"],
        gradient_compression=hvd.Compression.fp16 if case["fp16"] else None,
        transformation_fn=jobs.BatchRecorder(str(recorded)),
        store=str(tmp_path_factory.mktemp("store")))
    trained = est.fit(equivalence_frame).getModel()
    steps = jobs.EPOCHS * jobs.ROWS // (jobs.N * jobs.BATCH)
    batches = jobs.recorded_global_batches(str(recorded), jobs.N, steps, "features", "label")
    init = jobs.torch_weights(initial)
    lr = LR[case["opt"]] * (jobs.N if case["scale"] else 1)
    plain = jobs.torch_plain(initial, case["opt"], lr, jobs.merge_steps(batches, case["bpps"]))
    return {"name": request.param, "case": case, "batches": batches, "init": init,
            "plain": plain, "final": jobs.torch_weights(trained)}


def test_ranks_trained_on_every_row_each_epoch(fitted) -> None:
    x, _ = jobs.dataset()
    jobs.check_epochs_cover_dataset(fitted["batches"], jobs.EPOCHS, x)


def test_torch_estimator_matches_plain_torch(fitted) -> None:
    case, name = fitted["case"], fitted["name"]
    result = jobs.compare(fitted["final"], fitted["plain"], fitted["init"])
    print(f"TorchEstimator {name}: {result}")
    lr = LR[case["opt"]] * (jobs.N if case["scale"] else 1)
    result.check(jobs.tolerance(case["opt"], lr, case["fp16"]), f"TorchEstimator {name}")


def test_an_epoch_ending_inside_an_accumulation_steps_on_it(equivalence_frame, tmp_path) -> None:
    """3 steps an epoch with backward_passes_per_step=2: each epoch steps after batches 2
    and 3 (the last on half an accumulation, as Lightning does) and the next epoch starts a
    new accumulation. This fit failed in its second epoch before ("computed more than
    backward_passes_per_step=2 time(s) before step()")."""
    model = jobs.torch_model()
    initial = copy.deepcopy(model)
    lr = LR["sgd"]
    est = TorchEstimator(
        num_proc=jobs.N, model=model,
        optimizer=jobs.torch_optimizer("sgd", model.parameters(), lr),
        loss=torch.nn.CrossEntropyLoss(), feature_cols=["features"], label_cols=["label"],
        batch_size=jobs.BATCH, epochs=2, train_steps_per_epoch=3, shuffle=True,
        random_seed=7, verbose=0, use_gpu=False, backward_passes_per_step=2,
        scale_learning_rate=False, transformation_fn=jobs.BatchRecorder(str(tmp_path / "b")),
        store=str(tmp_path / "store"))
    (tmp_path / "b").mkdir()
    trained = est.fit(equivalence_frame).getModel()
    batches = jobs.recorded_global_batches(str(tmp_path / "b"), jobs.N, 6, "features", "label")
    # Per epoch: one step on batches 1-2 (their mean), one on batch 3 at half weight (its
    # loss was divided by 2 and nothing was added to it).
    steps = []
    for epoch in range(2):
        first, second, third = batches[3 * epoch:3 * epoch + 3]
        merged = jobs.merge_steps([first, second], 2)[0]
        steps += [(*merged, 1.0), (*third, 0.5)]
    init = jobs.torch_weights(initial)
    plain = jobs.torch_plain_weighted(initial, "sgd", lr, steps)
    result = jobs.compare(jobs.torch_weights(trained), plain, init)
    result.check(jobs.tolerance("sgd", lr, False), "TorchEstimator partial accumulation")
