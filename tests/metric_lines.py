"""The parser tables: for each framework, lines captured from real runs and what pai
must read from each (an empty pattern: a line nothing may read). The tests run every
line through the master's parser with the adapter's whole pattern list, so a pattern
that reads too much or steals another row's line fails there."""

from dataclasses import dataclass

from paicli.adapters.caffe import (AVERAGED_LOSS_METRIC, FIRST_ITERATION_METRIC, ITERATION_METRIC,
                                   LAST_ITERATION_METRIC, LR_METRIC, PS_ROUND_METRIC, ROUND_METRIC,
                                   TEST_LOSS_METRIC, TEST_OUTPUT_METRIC, TRAIN_OUTPUT_METRIC)
from paicli.adapters.mxnet import (EPOCH_SCORE_METRIC, EPOCH_TIME_METRIC, GLUON_BATCH_METRIC,
                                   GLUON_EPOCH_METRIC, GLUON_EPOCH_TIME_METRIC, GLUON_VALIDATION_METRIC,
                                   MX_KEY_VALUE_METRIC, SPEEDOMETER_METRIC)
from paicli.adapters.tensorflow import (CNN_BENCHMARK_EVAL_METRIC, CNN_BENCHMARK_STEP_METRIC,
                                        CNN_BENCHMARK_TOTAL_METRIC, KERAS_EPOCH_METRIC, KERAS_LOSS_METRIC,
                                        KERAS_METRIC, LOGGING_TENSOR_HOOK_METRIC, STEP_COUNTER_METRIC,
                                        TF_KEY_VALUE_METRIC)


@dataclass(frozen=True)
class LineRule:
    what: str                   # the line, in words (where it comes from)
    pattern: str                # the adapter's regex that reads it ("" for none)
    sample: str                 # a line captured from a real run of the framework
    reads: dict                 # what the whole table reads from `sample`: {metric: value}


def table_patterns(table: tuple[LineRule, ...]) -> tuple[str, ...]:
    """The patterns of a table, in its order, without repeats."""
    seen: list[str] = []
    for rule in table:
        if rule.pattern and rule.pattern not in seen:
            seen.append(rule.pattern)
    return tuple(seen)


_GLOG = "I1123 17:06:48.164947 15674 solver.cpp:239] "  # the glog head of the captured lines

# The Caffe parser table: lines captured from `caffe train` (BVLC Caffe 1.0, Debian's
# build) and from the runner's model averaging, and what pai reads from each.
CAFFE_LINES = (
    LineRule("caffe train display line", ITERATION_METRIC,
             _GLOG + "Iteration 20 (20000 iter/s, 0.001s/20 iters), loss = 1.0235",
             {"step": 20, "iter_per_s": 20000, "sec_per_display": 0.001, "loss": 1.0235}),
    LineRule("iteration 0: its rate is garbage", FIRST_ITERATION_METRIC,
             _GLOG + "Iteration 0 (2.75136e-27 iter/s, 0s/20 iters), loss = 1.50008", {"step": 0, "loss": 1.50008}),
    LineRule("the run's last line", LAST_ITERATION_METRIC,
             "I1123 17:06:48.412217 15674 solver.cpp:327] Iteration 200, loss = 0.350417",
             {"step": 200, "loss": 0.350417}),
    LineRule("learning rate", LR_METRIC,
             "I1123 17:06:48.164956 15674 sgd_solver.cpp:112] Iteration 20, lr = 0.01", {"step": 20, "lr": 0.01}),
    LineRule("train output: the loss is read above", TRAIN_OUTPUT_METRIC,
             "I1123 17:06:48.164954 15674 solver.cpp:258]     Train net output #0: loss = 1.0235 "
             "(* 1 = 1.0235 loss)", {}),
    LineRule("test loss", TEST_LOSS_METRIC,
             "I1123 17:06:48.163300 15674 solver.cpp:414]     Test net output #1: loss = 1.69035 "
             "(* 1 = 1.69035 loss)", {"test_loss": 1.69035}),
    LineRule("test accuracy", TEST_OUTPUT_METRIC,
             "I1123 17:06:48.163293 15674 solver.cpp:414]     Test net output #0: accuracy = 0.158203",
             {"accuracy": 0.158203}),
    LineRule("testing starts: not a metric", "",
             "I1123 17:06:48.163007 15674 solver.cpp:347] Iteration 0, Testing net (#0)", {}),
    LineRule("averaged model (runner, worker 0)", AVERAGED_LOSS_METRIC,
             "Averaged model loss = 0.412 (starting loss = 1.52)", {"averaged_loss": 0.412, "starting_loss": 1.52}),
    LineRule("averaging round (runner, a worker)", ROUND_METRIC,
             "model averaging round 3 at iteration 60: exchange took 1.8 ms",
             {"ma_round": 3, "step": 60, "exchange_ms": 1.8}),
    LineRule("averaging round (runner, the ps)", PS_ROUND_METRIC,
             "averaging round 3 at iteration 60: 2 workers, 0.03 MB, waited 2 ms, averaged in 0.1 ms",
             {"model_mb": 0.03}),
    LineRule("the ps's verdict when nothing was averaged: not a metric", "",
             "not distributed: ps:0 averaged nothing: the workers ended without one averaging round "
             "(no iterations left to run: max_iter reached, or a snapshot at it)", {}),
)

# The MXNet parser table: lines captured from real runs of MXNet 1.9.1, and what pai
# reads from each.
MXNET_LINES = (
    LineRule("Speedometer (Module.fit, Gluon image_classification.py)", SPEEDOMETER_METRIC,
             "INFO:root:Epoch[0] Batch [10-20]\tSpeed: 2169.50 samples/sec\taccuracy=0.789062",
             {"epoch": 0, "batch": 20, "speed": 2169.5, "accuracy": 0.789062}),
    LineRule("Speedometer with several metrics, older `Batch [N]`", SPEEDOMETER_METRIC,
             "Epoch[2] Batch [100]\tSpeed: 512.33 samples/sec\taccuracy=0.5\tcross-entropy=1.25",
             {"epoch": 2, "batch": 100, "speed": 512.33, "accuracy": 0.5, "cross-entropy": 1.25}),
    LineRule("Module.fit epoch time", EPOCH_TIME_METRIC, "INFO:root:Epoch[0] Time cost=1.464",
             {"epoch": 0, "epoch_seconds": 1.464}),
    LineRule("Module.fit train score", EPOCH_SCORE_METRIC, "INFO:root:Epoch[0] Train-accuracy=0.777593",
             {"epoch": 0, "Train-accuracy": 0.777593}),
    LineRule("Module.fit validation score", EPOCH_SCORE_METRIC,
             "INFO:root:Epoch[0] Validation-accuracy=0.996094",
             {"epoch": 0, "Validation-accuracy": 0.996094}),
    LineRule("Speedometer with two metrics (Gluon image_classification.py)", SPEEDOMETER_METRIC,
             "INFO:root:Epoch[1] Batch [49]\tSpeed: 87.082893 samples/sec\taccuracy=1.000000, top_k_accuracy_5=1.000000",
             {"epoch": 1, "batch": 49, "speed": 87.082893, "accuracy": 1.0, "top_k_accuracy_5": 1.0}),
    LineRule("Gluon epoch, training (image_classification.py)", GLUON_EPOCH_METRIC,
             "INFO:root:[Epoch 0] training: accuracy=1.000000, top_k_accuracy_5=0.990000",
             {"epoch": 0, "accuracy": 1.0, "top_k_accuracy_5": 0.99}),
    LineRule("Gluon epoch, training (mnist.py)", GLUON_EPOCH_METRIC, "[Epoch 0] Training: accuracy=0.627344",
             {"epoch": 0, "accuracy": 0.627344}),
    LineRule("Gluon batch (mnist.py)", GLUON_BATCH_METRIC,
             "[Epoch 0 Batch 10] Training: accuracy=0.326705", {"epoch": 0, "batch": 10, "accuracy": 0.326705}),
    LineRule("Gluon epoch, time", GLUON_EPOCH_TIME_METRIC, "INFO:root:[Epoch 0] time cost: 4.479419",
             {"epoch": 0, "epoch_seconds": 4.479419}),
    LineRule("Gluon epoch, validation (mnist.py)", GLUON_VALIDATION_METRIC, "[Epoch 0] Validation: accuracy=0.914062",
             {"epoch": 0, "validation_accuracy": 0.914062}),
    LineRule("Gluon epoch, validation with two metrics (image_classification.py)", GLUON_VALIDATION_METRIC,
             "INFO:root:[Epoch 0] validation: accuracy=1.000000, top_k_accuracy_5=1.000000",
             {"epoch": 0, "validation_accuracy": 1.0, "validation_top_k_accuracy_5": 1.0}),
    LineRule("Gluon checkpoint notice (image_classification.py): not metrics", "",
             "INFO:root:[Epoch 0] Saving checkpoint to mobilenet0.25_best.params with Accuracy: 1.0000", {}),
    LineRule("a script's own step line (examples/mxnet)", MX_KEY_VALUE_METRIC,
             "step=12, loss=0.2630, duration=0.006s", {"step": 12, "loss": 0.263, "duration": 0.006}),
    LineRule("argparse settings printed by fit.py: not metrics", "",
             "INFO:root:start with arguments Namespace(network='lenet', num_layers=50, gpus=None, "
             "kv_store='device', num_epochs=2, lr=0.1, lr_factor=0.1, batch_size=32, disp_batches=5, "
             "image_shape='1,28,28', num_classes=10, num_examples=640, benchmark=1)", {}),
    LineRule("MXNet's own notices: not metrics", "",
             "[17:05:50] ../src/executor/graph_executor.cc:1991: Subgraph backend MKLDNN is activated.", {}),
    LineRule("the runner's kvstore flag line: not metrics", "",
             "mxnet_runner: passing --kv-store=dist_sync (-Dkvstore) to the script, which defines --kv-store", {}),
    LineRule("the runner's verdict on a worker that trained alone: not metrics", "",
             "mxnet_runner: not distributed: worker:1 trained alone: the script created kvstore 'device'; "
             "pass --kv-store dist_sync, or leave --kv-store out so that -Dkvstore reaches the script", {}),
)

# The TensorFlow parser table: each row a line captured from a real run and what the
# whole table reads from it. Rows with no pattern are lines nothing may read.
TF_LINES = (
    LineRule("the seed's step line (examples/tensorflow/async_ps_worker.py)", TF_KEY_VALUE_METRIC,
             "step=25, global_step=41, loss=0.0099, duration=0.005s.",
             {"step": 25, "global_step": 41, "loss": 0.0099, "duration": 0.005}),
    LineRule("tf_cnn_benchmarks step (trivial, sync)", CNN_BENCHMARK_STEP_METRIC,
             "20\timages/sec: 75.0 +/- 1.5 (jitter = 4.9)\t32.641",
             {"step": 20, "images_per_sec": 75.0, "loss": 32.641}),
    LineRule("tf_cnn_benchmarks step (lenet, async)", CNN_BENCHMARK_STEP_METRIC,
             "10\timages/sec: 90.1 +/- 5.6 (jitter = 8.9)\t3122239787064721670144.000",
             {"step": 10, "images_per_sec": 90.1, "loss": 3.122239787064721670144e21}),
    LineRule("tf_cnn_benchmarks step, a diverged loss (its '%.*f' of NaN)", CNN_BENCHMARK_STEP_METRIC,
             "15\timages/sec: 88.2 +/- 4.1 (jitter = 9.0)\tnan",
             {"step": 15, "images_per_sec": 88.2}),
    LineRule("tf_cnn_benchmarks step with --print_training_accuracy", CNN_BENCHMARK_STEP_METRIC,
             "100\timages/sec: 412.3 +/- 0.9 (jitter = 3.1)\t7.112\t0.001\t0.006",
             {"step": 100, "images_per_sec": 412.3, "loss": 7.112, "top_1_accuracy": 0.001,
              "top_5_accuracy": 0.006}),
    LineRule("tf_cnn_benchmarks total", CNN_BENCHMARK_TOTAL_METRIC, "total images/sec: 148.43",
             {"total_images_per_sec": 148.43}),
    LineRule("tf_cnn_benchmarks eval", CNN_BENCHMARK_EVAL_METRIC,
             "Accuracy @ 1 = 0.0010 Accuracy @ 5 = 0.0050 [50000 examples]",
             {"top_1_accuracy": 0.001, "top_5_accuracy": 0.005}),
    LineRule("tf_cnn_benchmarks header: not metrics", "", "Step\tImg/sec\ttotal_loss", {}),
    LineRule("LoggingTensorHook, Estimator", LOGGING_TENSOR_HOOK_METRIC,
             "INFO:tensorflow:loss = 0.52, step = 100 (0.311 sec)", {"loss": 0.52, "step": 100}),
    LineRule("StepCounterHook (MonitoredTrainingSession, log_step_count_steps)", STEP_COUNTER_METRIC,
             "INFO:tensorflow:global_step/sec: 5193.86", {"global_steps_per_sec": 5193.86}),
    LineRule("MonitoredTrainingSession's global-step warning: not a metric", "",
             "WARNING:tensorflow:It seems that global step (tf.train.get_global_step) has not been increased. "
             "Current value (could be stable): 17 vs previous value: 17. You could increase the global step by "
             "passing tf.train.get_global_step() to Optimizer.apply_gradients or Optimizer.minimize.", {}),
    LineRule("Keras 3, verbose=2", KERAS_METRIC,
             "6/6 - 0s - 12ms/step - accuracy: 0.5156 - loss: 0.6621 - val_accuracy: 0.4688 - val_loss: 0.6742",
             {"accuracy": 0.5156, "loss": 0.6621, "val_accuracy": 0.4688, "val_loss": 0.6742}),
    LineRule("Keras 3, verbose=1 bar into a pipe (its last redraw: ANSI colours, no \\r)", KERAS_METRIC,
             "\x1b[1m6/6\x1b[0m \x1b[32m━━━━━━━━━━━━━━━━━━━━\x1b[0m\x1b[37m\x1b[0m \x1b[1m1s\x1b[0m 79ms/step - "
             "accuracy: 0.4792 - loss: 0.7134 - val_accuracy: 0.6250 - val_loss: 0.6671",
             {"accuracy": 0.4792, "loss": 0.7134, "val_accuracy": 0.625, "val_loss": 0.6671}),
    LineRule("legacy Keras 2 (tf-keras), verbose=2", KERAS_LOSS_METRIC,
             "6/6 - 1s - loss: 0.7619 - accuracy: 0.5104 - val_loss: 0.8089 - val_accuracy: 0.3750 "
             "- 817ms/epoch - 136ms/step",
             {"loss": 0.7619, "accuracy": 0.5104, "val_loss": 0.8089, "val_accuracy": 0.375}),
    LineRule("legacy Keras 2, verbose=1 bar (its last redraw)", KERAS_METRIC,
             "8/8 [==============================] - 0s 1ms/step - loss: 0.7575 - accuracy: 0.4688",
             {"loss": 0.7575, "accuracy": 0.4688}),
    LineRule("Keras epoch", KERAS_EPOCH_METRIC, "Epoch 2/2", {"epoch": 2}),
    LineRule("TensorFlow's import notice: not a metric", "",
             "I0000 00:00:1795453614.777263   15864 port.cc:153] oneDNN custom operations are on. "
             "To turn them off, set the environment variable `TF_ENABLE_ONEDNN_OPTS=0`.", {}),
)
