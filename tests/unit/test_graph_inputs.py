"""The staged inputs of graphed decode steps (engine/worker/graph_inputs.py): after every write the static tensors hold
each row's inputs and block table, however the rows change from step to step."""

import random

import torch

from loraplex.engine.worker.graph_inputs import StagedInputs

PAD_COLUMN = [0, 0, 999, 1, -1]
PAD_TABLE = [63]


def check(static, tables, columns, blocks, bucket):
    rows = len(blocks)
    for k, column in enumerate(columns):
        assert static[k, :rows].tolist() == list(column)
        assert static[k, rows:bucket].tolist() == [PAD_COLUMN[k]] * (bucket - rows)
    for i, table in enumerate(blocks):
        assert tables[i, : len(table)].tolist() == table
    for i in range(rows, bucket):
        assert tables[i, 0].item() == PAD_TABLE[0]


def test_rows_that_grow_change_hands_shrink_and_turn_to_padding_are_written_right():
    rng = random.Random(0)
    static, tables = torch.zeros(5, 16, dtype=torch.long), torch.zeros(16, 12, dtype=torch.long)
    staged = StagedInputs(static, tables)
    running = [[rng.randrange(60) for _ in range(rng.randint(1, 6))] for _ in range(10)]
    for step in range(60):
        for table in running:  # a running request's table only grows
            if rng.random() < 0.3 and len(table) < 12:
                table.append(rng.randrange(60))
        if rng.random() < 0.3 and running:  # one finishes; its row goes to the next request, or to padding
            running.pop(rng.randrange(len(running)))
        if rng.random() < 0.3 and len(running) < 16:  # a new, shorter request, maybe reusing freed blocks
            running.insert(rng.randrange(len(running) + 1), [rng.randrange(60) for _ in range(rng.randint(1, 3))])
        if not running:
            continue
        rows = len(running)
        bucket = min(b for b in (1, 2, 4, 8, 16) if b >= rows)
        columns = [[rng.randrange(1000) for _ in range(rows)] for _ in range(5)]
        blocks = [list(t) for t in running]
        staged.write(columns, blocks, bucket, PAD_COLUMN, PAD_TABLE)
        check(static, tables, columns, blocks, bucket)


def test_a_row_whose_blocks_are_replaced_by_others_of_the_same_length_is_rewritten():
    static, tables = torch.zeros(5, 2, dtype=torch.long), torch.zeros(2, 4, dtype=torch.long)
    staged = StagedInputs(static, tables)
    columns = [[1]] * 5
    staged.write(columns, [[5, 6, 7]], 1, PAD_COLUMN, PAD_TABLE)
    staged.write(columns, [[5, 6, 8]], 1, PAD_COLUMN, PAD_TABLE)  # same length, same first blocks, other last
    assert tables[0, :3].tolist() == [5, 6, 8]
