"""Flax's NNX MNIST tutorial of ``jax_train.py`` trained through pathways: imports, a slice and the two
decorators changed.

    python -m examples.nnx_mnist.pw_train

``@nnx.jit`` becomes ``@pw.nnx.jit(slice=s, ...)`` with the batch split over the slice's "data" axis. The
model, optimizer and metrics are the same objects, updated in place by each step; their arrays live on
the slice from the first step on, and ``metrics.compute()`` reads them there. ``python -m
examples.nnx_mnist`` runs both and compares the losses and accuracies.
"""

from __future__ import annotations

from functools import partial

import numpy as np
import optax
from flax import nnx
from jax.sharding import PartitionSpec as P

import pathways as pw


def digits(split: str, steps: int, batch_size: int, image_size: int):
    """``steps`` batches of {'image': float32[batch, size, size, 1], 'label': int32[batch]}: ten fixed stroke
    patterns, one per class, shifted by a pixel and noisy (the test split draws other samples)."""
    templates = np.zeros((10, image_size + 2, image_size + 2), np.float32)
    strokes = np.random.default_rng(0).integers(1, image_size + 1, size=(10, 4, 2))
    for label, points in enumerate(strokes):
        for (r0, c0), (r1, c1) in zip(points[:-1], points[1:]):
            for t in np.linspace(0.0, 1.0, 2 * image_size):
                templates[label, round(r0 + t * (r1 - r0)), round(c0 + t * (c1 - c0))] = 1.0
    rng = np.random.default_rng({"train": 1, "test": 2}[split])
    for _ in range(steps):
        label = rng.integers(0, 10, batch_size)
        dr, dc = rng.integers(0, 3, (2, batch_size))
        image = np.stack([templates[k, r:r + image_size, c:c + image_size] for k, r, c in zip(label, dr, dc)])
        image = image + rng.normal(0.0, 0.3, image.shape).astype(np.float32)
        yield {"image": image[..., None].astype(np.float32), "label": label.astype(np.int32)}


class CNN(nnx.Module):
    """A simple CNN model."""

    def __init__(self, *, image_size: int, features: tuple[int, int], hidden: int, rngs: nnx.Rngs) -> None:
        self.conv1 = nnx.Conv(1, features[0], kernel_size=(3, 3), rngs=rngs)
        self.batch_norm1 = nnx.BatchNorm(features[0], rngs=rngs)
        self.dropout1 = nnx.Dropout(rate=0.025, rngs=rngs)
        self.conv2 = nnx.Conv(features[0], features[1], kernel_size=(3, 3), rngs=rngs)
        self.batch_norm2 = nnx.BatchNorm(features[1], rngs=rngs)
        self.avg_pool = partial(nnx.avg_pool, window_shape=(2, 2), strides=(2, 2))
        self.linear1 = nnx.Linear((image_size // 4) ** 2 * features[1], hidden, rngs=rngs)
        self.dropout2 = nnx.Dropout(rate=0.025, rngs=rngs)
        self.linear2 = nnx.Linear(hidden, 10, rngs=rngs)

    def __call__(self, x):
        x = self.avg_pool(nnx.relu(self.batch_norm1(self.dropout1(self.conv1(x)))))
        x = self.avg_pool(nnx.relu(self.batch_norm2(self.conv2(x))))
        x = x.reshape(x.shape[0], -1)  # flatten
        x = nnx.relu(self.dropout2(self.linear1(x)))
        x = self.linear2(x)
        return x


def loss_fn(model: CNN, batch):
    logits = model(batch["image"])
    loss = optax.softmax_cross_entropy_with_integer_labels(logits=logits, labels=batch["label"]).mean()
    return loss, logits


def train(train_steps: int = 120, eval_every: int = 40, batch_size: int = 32, image_size: int = 16,
          features: tuple[int, int] = (16, 32), hidden: int = 64, test_steps: int = 4) -> dict[str, list[float]]:
    model = CNN(image_size=image_size, features=features, hidden=hidden, rngs=nnx.Rngs(0))
    optimizer = nnx.Optimizer(model, optax.adamw(0.005, 0.9), wrt=nnx.Param)
    metrics = nnx.MultiMetric(accuracy=nnx.metrics.Accuracy(), loss=nnx.metrics.Average("loss"))
    s = pw.slice((2,), ("data",))

    @pw.nnx.jit(slice=s, in_specs={"batch": P("data")})
    def train_step(model: CNN, optimizer: nnx.Optimizer, metrics: nnx.MultiMetric, batch):
        """Train for a single step."""
        grad_fn = nnx.value_and_grad(loss_fn, has_aux=True)
        (loss, logits), grads = grad_fn(model, batch)
        metrics.update(loss=loss, logits=logits, labels=batch["label"])  # In-place updates.
        optimizer.update(model, grads)  # In-place updates.

    @pw.nnx.jit(slice=s, in_specs={"batch": P("data")})
    def eval_step(model: CNN, metrics: nnx.MultiMetric, batch):
        loss, logits = loss_fn(model, batch)
        metrics.update(loss=loss, logits=logits, labels=batch["label"])  # In-place updates.

    metrics_history = {"train_loss": [], "train_accuracy": [], "test_loss": [], "test_accuracy": []}
    for step, batch in enumerate(digits("train", train_steps, batch_size, image_size)):
        model.train()  # Switch to train mode (dropout on, batch statistics).
        train_step(model, optimizer, metrics, batch)
        if step > 0 and (step % eval_every == 0 or step == train_steps - 1):
            for metric, value in metrics.compute().items():  # Compute the metrics.
                metrics_history[f"train_{metric}"].append(float(value))
            metrics.reset()  # Reset the metrics for the test set.
            model.eval()  # Switch to eval mode (no dropout, running statistics).
            for test_batch in digits("test", test_steps, batch_size, image_size):
                eval_step(model, metrics, test_batch)
            for metric, value in metrics.compute().items():
                metrics_history[f"test_{metric}"].append(float(value))
            metrics.reset()
            print(f"[train] step: {step}, loss: {metrics_history['train_loss'][-1]:.4f}, "
                  f"accuracy: {metrics_history['train_accuracy'][-1] * 100:.1f}")
            print(f"[test]  step: {step}, loss: {metrics_history['test_loss'][-1]:.4f}, "
                  f"accuracy: {metrics_history['test_accuracy'][-1] * 100:.1f}")
    return metrics_history


def main() -> None:
    pw.init(topology=pw.Topology(islands=1, hosts_per_island=1, devices_per_host=2))
    train()
    pw.shutdown()


if __name__ == "__main__":
    main()
