"""The TorchEstimator's metric names: Horovod's ``group_<i>_<label>`` kept in the records
(``getHistory()`` reads them), Keras-style plain names added and shown."""

from __future__ import annotations

from hvd_spark.estimator import history as hist


def accuracy(out, label):
    return 1.0


def test_one_label_column_gets_the_functions_own_names():
    def mae(out, label):
        return 0.0

    names = hist.plain_metric_names([[accuracy], [mae]], ["label"])
    assert names == {"group_0_label": "accuracy", "group_1_label": "mae"}


def test_several_labels_lambdas_and_clashes_stay_unique():
    groups = [[accuracy], [lambda o, y: 0.0, accuracy], [accuracy]]
    names = hist.plain_metric_names(groups, ["a", "b"])
    assert names == {"group_0_a": "a_accuracy", "group_0_b": "b_accuracy",
                     "group_1_a": "a_metric_1", "group_1_b": "b_accuracy_1",
                     "group_2_a": "a_accuracy_2", "group_2_b": "b_accuracy_2"}
    assert hist.plain_metric_names([[lambda o, y: 0.0]], ["loss"]) == {
        "group_0_loss": "metric_0"}


def test_records_hold_both_names_and_the_console_gets_the_plain_ones():
    names = hist.plain_metric_names([[accuracy]], ["label"])
    record = {"epoch": 1, "loss": 0.5, "group_0_label": 0.9, "val_loss": 0.6,
              "val_group_0_label": 0.8}
    both = hist.with_plain_names(record, names)
    assert both == {**record, "accuracy": 0.9, "val_accuracy": 0.8}
    assert hist.displayed(both, names) == {"epoch": 1, "loss": 0.5, "val_loss": 0.6,
                                           "accuracy": 0.9, "val_accuracy": 0.8}
