-- The machine a change set was staged on, so it applies there whoever staged it: a turn of a
-- sessions-API session, or an MCP client whose session id has no session row. NULL (sets
-- staged before this column): the session's machine.
ALTER TABLE change_sets ADD COLUMN machine TEXT;
