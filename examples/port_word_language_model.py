"""A stateful truncated-BPTT LSTM language model: its own loop, and the same program on
steadytrain.

Origin: the word-level language model of pytorch/examples (word_language_model/main.py and
model.py; BSD 3-Clause License, Copyright (c) 2017 PyTorch contributors): a corpus batchified
into `batch_size` columns; an embedding, a multi-layer LSTM and a linear decoder with dropout and
log-softmax, weights uniform in ±0.1; each epoch starts from a zero hidden state that is carried
from batch to batch (detached: truncated backpropagation through `bptt` tokens), the gradient
clipped at 0.25 and plain SGD at lr 20; after each epoch the validation loss (its own hidden
state, batches of 10) decides: the best model is saved, otherwise the lr is divided by 4.
Written again here, not copied. Changed: small sizes, and the corpus is the text of a module of
Python's standard library (textwrap.py) instead of Penn Treebank.

    python examples/port_word_language_model.py [RUN_DIR]

The port keeps the hidden state in a `CarriedState` (saved in checkpoints, per sample when the
batch is split, untouched by steadytrain's extra passes), clips with max_grad_norm 0.25, and
turns "divide the lr by 4 when validation does not improve" into ReduceLROnPlateau(factor 0.25,
patience 0, threshold 0), driven by the evaluation; keep_best saves the best model.
"""

from __future__ import annotations

import importlib
import sys
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import Dataset


@dataclass(frozen=True)
class Sizes:
    emsize: int = 16
    nhid: int = 16
    nlayers: int = 2
    dropout: float = 0.2
    batch_size: int = 8
    eval_batch_size: int = 4
    bptt: int = 6
    lines: int = 160  # lines of the corpus used for training (then a quarter for validation)
    source: str = "textwrap"  # the standard-library module whose text is the corpus
    lr: float = 20.0
    clip: float = 0.25
    epochs: int = 2
    seed: int = 1111


class Corpus:
    """Words of a standard-library module's source, one <eos> per line, as the original's
    `data.Corpus` reads its train and valid files."""

    def __init__(self, sizes: Sizes):
        module = importlib.import_module(sizes.source)
        lines = Path(module.__file__).read_text().splitlines()
        self.words: dict[str, int] = {}
        split = sizes.lines + sizes.lines // 4
        self.train = self.tokenize(lines[: sizes.lines])
        self.valid = self.tokenize(lines[sizes.lines : split])

    def tokenize(self, lines: list[str]) -> torch.Tensor:
        ids = []
        for line in lines:
            for word in [*line.split(), "<eos>"]:
                ids.append(self.words.setdefault(word, len(self.words)))
        return torch.tensor(ids, dtype=torch.int64)


def batchify(data: torch.Tensor, bsz: int) -> torch.Tensor:
    nbatch = data.size(0) // bsz
    return data.narrow(0, 0, nbatch * bsz).view(bsz, -1).t().contiguous()


class RNNModel(nn.Module):
    def __init__(self, ntoken: int, sizes: Sizes):
        super().__init__()
        self.drop = nn.Dropout(sizes.dropout)
        self.encoder = nn.Embedding(ntoken, sizes.emsize)
        self.rnn = nn.LSTM(sizes.emsize, sizes.nhid, sizes.nlayers, dropout=sizes.dropout)
        self.decoder = nn.Linear(sizes.nhid, ntoken)
        self.nlayers, self.nhid, self.ntoken = sizes.nlayers, sizes.nhid, ntoken
        nn.init.uniform_(self.encoder.weight, -0.1, 0.1)
        nn.init.zeros_(self.decoder.bias)
        nn.init.uniform_(self.decoder.weight, -0.1, 0.1)

    def forward(self, tokens, hidden):
        output, hidden = self.rnn(self.drop(self.encoder(tokens)), hidden)
        decoded = self.decoder(self.drop(output)).view(-1, self.ntoken)
        return F.log_softmax(decoded, dim=1), hidden

    def init_hidden(self, bsz: int):
        weight = next(self.parameters())
        return (
            weight.new_zeros(self.nlayers, bsz, self.nhid),
            weight.new_zeros(self.nlayers, bsz, self.nhid),
        )


def get_batch(source: torch.Tensor, i: int, bptt: int):
    seq_len = min(bptt, len(source) - 1 - i)
    return source[i : i + seq_len], source[i + 1 : i + 1 + seq_len].reshape(-1)


def repackage_hidden(h):
    return h.detach() if isinstance(h, torch.Tensor) else tuple(repackage_hidden(v) for v in h)


# -- the program's own loop --------------------------------------------------------------------


def original(sizes: Sizes = Sizes()) -> tuple[RNNModel, list[float], list[float]]:
    torch.manual_seed(sizes.seed)
    corpus = Corpus(sizes)
    train_data = batchify(corpus.train, sizes.batch_size)
    val_data = batchify(corpus.valid, sizes.eval_batch_size)
    model = RNNModel(len(corpus.words), sizes)
    criterion = nn.NLLLoss()
    lr, best_val_loss, losses, val_losses = sizes.lr, None, [], []

    def evaluate(data_source):
        model.eval()
        total_loss = 0.0
        hidden = model.init_hidden(sizes.eval_batch_size)
        with torch.no_grad():
            for i in range(0, data_source.size(0) - 1, sizes.bptt):
                data, targets = get_batch(data_source, i, sizes.bptt)
                output, hidden = model(data, hidden)
                hidden = repackage_hidden(hidden)
                total_loss += len(data) * criterion(output, targets).item()
        return total_loss / (len(data_source) - 1)

    for _ in range(sizes.epochs):
        model.train()
        hidden = model.init_hidden(sizes.batch_size)
        for i in range(0, train_data.size(0) - 1, sizes.bptt):
            data, targets = get_batch(train_data, i, sizes.bptt)
            model.zero_grad()
            hidden = repackage_hidden(hidden)
            output, hidden = model(data, hidden)
            loss = criterion(output, targets)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), sizes.clip)
            for p in model.parameters():
                p.data.add_(p.grad, alpha=-lr)
            losses.append(loss.item())
        val_loss = evaluate(val_data)
        val_losses.append(val_loss)
        if not best_val_loss or val_loss < best_val_loss:
            best_val_loss = val_loss  # the original saves the model here
        else:
            lr /= 4.0
    return model, losses, val_losses


# -- the same program on steadytrain -----------------------------------------------------------


class Columns(Dataset):
    """Sample k of batch b is column k of the b-th bptt chunk: batches of `columns` samples in
    order are the original's get_batch(source, b * bptt), transposed."""

    def __init__(self, source: torch.Tensor, bptt: int):
        self.source, self.bptt, self.columns = source, bptt, source.size(1)
        self.chunks = len(range(0, source.size(0) - 1, bptt))

    def __len__(self):
        return self.chunks * self.columns

    def __getitem__(self, index):
        chunk, column = divmod(index, self.columns)
        data, _ = get_batch(self.source, chunk * self.bptt, self.bptt)
        i = chunk * self.bptt
        return data[:, column], self.source[i + 1 : i + 1 + len(data), column]


def port(run_dir: str, sizes: Sizes = Sizes(), callbacks=(), **settings):
    from steadytrain import CarriedState, TrainConfig, Trainer

    torch.manual_seed(sizes.seed)
    corpus = Corpus(sizes)
    train_data = batchify(corpus.train, sizes.batch_size)
    val_data = batchify(corpus.valid, sizes.eval_batch_size)
    model = RNNModel(len(corpus.words), sizes)
    criterion = nn.NLLLoss()
    hidden = CarriedState(init=model.init_hidden, batch_dim=1, reset_each_epoch=True)

    def loss_fn(model, batch):
        data, targets = batch  # [samples, seq]: the original's [seq, samples], transposed
        output, new = model(data.t(), hidden.get())
        hidden.set(new)
        return criterion(output, targets.t().reshape(-1))

    def evaluate(model, batches):  # the original's evaluate(): its own hidden, from zeros
        total_loss = 0.0
        for data, targets in batches:
            output, new = model(data.t(), hidden.get())
            hidden.set(new)
            total_loss += data.size(1) * criterion(output, targets.t().reshape(-1)).item()
        return {"val_loss": total_loss / (len(val_data) - 1)}

    config = TrainConfig(
        run_dir=run_dir,
        effective_batch_size=sizes.batch_size,
        epochs=sizes.epochs,
        shuffle=False,
        drop_last=False,
        seed=None,  # the program seeded torch itself; keep its stream (dropout masks)
        max_grad_norm=sizes.clip,
        eval_batch=sizes.eval_batch_size,
        eval_metric="val_loss",
        keep_best=True,
        **settings,
    )
    result = Trainer(
        model,
        lambda params: torch.optim.SGD(params, lr=sizes.lr),
        loss_fn,
        Columns(train_data, sizes.bptt),
        config,
        scheduler=lambda opt: torch.optim.lr_scheduler.ReduceLROnPlateau(
            opt, factor=0.25, patience=0, threshold=0.0
        ),
        eval_data=Columns(val_data, sizes.bptt),
        eval_fn=evaluate,
        user_state={"hidden": hidden},
        callbacks=callbacks,
    ).fit()
    return model, result


if __name__ == "__main__":
    port(sys.argv[1] if len(sys.argv) > 1 else "runs/word-lm", device="cpu")
