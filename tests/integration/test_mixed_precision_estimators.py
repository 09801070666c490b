"""The Estimators in mixed precision (issue 47), 2 ranks against one process.

``TorchEstimator(mixed_precision="fp16")`` trains under float16 autocast with a
``GradScaler`` in Horovod's order; a ``KerasEstimator`` given a model built under the
``mixed_float16`` policy trains it (``model.compile`` wraps the DistributedOptimizer in
a ``LossScaleOptimizer``), and the fitted model saves, loads and transforms. Both end
where one process ends on the global batches the ranks recorded, in the same precision,
within ``mixed_precision_jobs``'s tolerance.
"""

from __future__ import annotations

import copy
import io
import posixpath

import keras
import numpy as np
import pyspark  # noqa: F401 - CI installs it: never a skip
import torch

from hvd_spark.estimator import KerasEstimator, TorchEstimator
from hvd_spark.estimator.keras import KerasModel
from tests.integration import equivalence_jobs as jobs
from tests.integration import mixed_precision_jobs as mj

EPOCHS = 1
STEPS = EPOCHS * jobs.ROWS // (jobs.N * jobs.BATCH)


def _fit_kwargs(tmp_path) -> dict:
    (tmp_path / "batches").mkdir()
    return dict(num_proc=jobs.N, feature_cols=["features"], label_cols=["label"],
                batch_size=jobs.BATCH, epochs=EPOCHS, shuffle=True, random_seed=7, verbose=0,
                use_gpu=False, scale_learning_rate=False,
                transformation_fn=jobs.BatchRecorder(str(tmp_path / "batches")),
                store=str(tmp_path / "store"))


def test_torch_estimator_fp16_matches_one_process(equivalence_frame, tmp_path) -> None:
    model = jobs.torch_model()
    initial = jobs.torch_weights(copy.deepcopy(model))
    est = TorchEstimator(model=model, optimizer=jobs.torch_optimizer("sgd", model.parameters(),
                                                                      mj.LR),
                         loss=torch.nn.CrossEntropyLoss(), mixed_precision="fp16",
                         **_fit_kwargs(tmp_path))
    assert est.getMixedPrecision() == "fp16"
    fitted = est.fit(equivalence_frame)
    batches = jobs.recorded_global_batches(str(tmp_path / "batches"), jobs.N, STEPS,
                                           "features", "label")
    # GradScaler's default scale (2^16), as the Estimator's. A step skipped on one side
    # only (an overflow) would differ by a whole step and fail the comparison.
    plain = mj.torch_amp_plain(initial, "fp16", batches=batches, init_scale=2.0 ** 16)
    result = jobs.compare(jobs.torch_weights(fitted.getModel()), plain, initial)
    print(f"TorchEstimator fp16: {result}")
    result.check(mj.TOLERANCE["fp16"], "TorchEstimator mixed_precision='fp16'")
    out = fitted.transform(equivalence_frame).select("label__output").collect()
    assert len(out) == jobs.ROWS and np.isfinite([r[0] for r in out]).all()


def test_keras_estimator_mixed_float16_fits_saves_loads_transforms(equivalence_frame,
                                                                   tmp_path) -> None:
    keras.mixed_precision.set_global_policy("mixed_float16")
    try:
        model = jobs.keras_model()
    finally:
        keras.mixed_precision.set_global_policy("float32")
    initial = [np.asarray(w) for w in model.get_weights()]
    est = KerasEstimator(model=model, optimizer=keras.optimizers.SGD(mj.LR,
                                                                     momentum=jobs.MOMENTUM),
                         loss=jobs.keras_loss(), **_fit_kwargs(tmp_path))
    fitted = est.fit(equivalence_frame)
    trained = fitted.getModel()
    assert trained.layers[0].dtype_policy.name == "mixed_float16"
    batches = jobs.recorded_global_batches(str(tmp_path / "batches"), jobs.N, STEPS,
                                           "features", "label")
    plain = mj.keras_mixed_plain(initial, "mixed_float16", batches=batches,
                                 initial_scale=2.0 ** 15)  # compile's LossScaleOptimizer
    result = jobs.compare([np.asarray(w) for w in trained.get_weights()], plain, initial)
    print(f"KerasEstimator mixed_float16: {result}")
    result.check(mj.TOLERANCE["fp16"], "KerasEstimator mixed_float16")

    fitted.save(str(tmp_path / "saved"))
    loaded = KerasModel.load(str(tmp_path / "saved"))
    assert loaded.getModel().layers[0].dtype_policy.name == "mixed_float16"
    for a, b in zip(loaded.getModel().get_weights(), trained.get_weights(), strict=True):
        np.testing.assert_array_equal(a, b)
    before = fitted.transform(equivalence_frame).select("label__output").collect()
    after = loaded.transform(equivalence_frame).select("label__output").collect()
    assert len(after) == jobs.ROWS and np.isfinite([r[0] for r in after]).all()
    assert [r[0] for r in after] == [r[0] for r in before]


def _overflowing_fit(store: str, run_id: str) -> TorchEstimator:
    """fp16 with targets far from the initial outputs: the scaled gradients overflow
    float16 at GradScaler's initial scale (2^16), so the first steps are skipped while the
    scale falls (the test checks that it fell)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(jobs.FEATURES, 16), torch.nn.ReLU(),
                                torch.nn.Linear(16, 1))
    return TorchEstimator(
        num_proc=jobs.N, model=model, optimizer=torch.optim.Adam(model.parameters(), lr=0.01),
        loss=torch.nn.MSELoss(), feature_cols=["features"], label_cols=["target"],
        batch_size=jobs.BATCH, epochs=2, shuffle=True, random_seed=7, verbose=0,
        use_gpu=False, mixed_precision="fp16", store=store, run_id=run_id)


def _scaler_state(store, run_id: str, epoch: int) -> dict:
    data = store.read_bytes(posixpath.join(store.checkpoints_path(run_id),
                                           f"epoch-{epoch:06d}.ckpt"))
    return torch.load(io.BytesIO(data), weights_only=False)["scaler"]


def test_torch_estimator_fp16_resumes_at_the_saved_loss_scale(spark, tmp_path) -> None:
    from hvd_spark.data.store import Store

    x, _ = jobs.dataset()
    targets = 200.0 * x[:, 0] + 100.0
    frame = spark.createDataFrame([(a.tolist(), float(t)) for a, t in zip(x, targets)],
                                  "features array<float>, target double")
    store_path = str(tmp_path / "store")
    store = Store.create(store_path)
    full = _overflowing_fit(store_path, "full").fit(frame)
    after_first = _scaler_state(store, "full", 0)
    # The test means something only if epoch 1 lowered the scale (overflows happened).
    assert after_first["scale"] < 2.0 ** 16, after_first

    # A fit that resumes from the first epoch's checkpoint (as a retry after a lost
    # executor does) must go on at that scale: restarting at 2^16 would skip the first
    # steps of epoch 2 again and end with other weights.
    name = "epoch-000000.ckpt"
    store.write_bytes(posixpath.join(store.checkpoints_path("resumed"), name),
                      store.read_bytes(posixpath.join(store.checkpoints_path("full"), name)))
    resumed = _overflowing_fit(store_path, "resumed").fit(frame)
    assert [h["epoch"] for h in resumed.getHistory()] == [0, 1]
    a, b = full.getModel().state_dict(), resumed.getModel().state_dict()
    for key in a:
        assert torch.equal(a[key], b[key]), key
    assert _scaler_state(store, "resumed", 1) == _scaler_state(store, "full", 1)
