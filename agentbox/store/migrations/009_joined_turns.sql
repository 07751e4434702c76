-- A message that arrived while a turn ran and was taken into that turn at a step boundary
-- (Flue's turn-boundary join): `joined_into` names the turn that answers it. A joined turn
-- runs as part of that turn and reaches its terminal state with it, in the same transaction.
ALTER TABLE turns ADD COLUMN joined_into TEXT REFERENCES turns (id);
