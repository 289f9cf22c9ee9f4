"""The async room of the trainer: where groups are born, kept and chosen between updates.

(``async`` is a Python keyword, hence the name.) What is inside, in the order a group meets it:

* ``stream.py`` — :class:`~postrl.trainer.asynchronous.stream.GroupStream`: prompts in,
  complete groups out, one path for every data plane (``runner.run(row)`` →
  ``buffer.finish(key, handle, tag)`` → ``collate(buffer.assemble(uids))``); every trainer
  mode, ``sync`` included, draws its batches from one;
* ``replay/`` — :class:`~postrl.trainer.asynchronous.replay.ReplayBuffer`: the owner of each
  group (tags, payloads through its store), staleness, DAPO filter, samplers;
* ``feed.py`` — :class:`~postrl.trainer.asynchronous.feed.AsyncFeed`: what both off-policy
  modes share (their stream, the admission budget, the taken batch's bookkeeping,
  snapshot/restore);
* ``one_step_off.py`` and ``fully_async.py`` — the two off-policy modes, each only its
  schedule (when to fill, take, pause and push weights);
* ``idle_switch.py`` — ``fully_async``'s idle switch (the trainer's cores generate while it
  would wait).

Nothing is imported here: ``postrl.trainer`` imports the modes (registering them), and each
module is imported by its own path.
"""
