"""The scheduler core: one pool of KV blocks, its requests and the rules of a step, with no
threads, clocks or I/O (the daemon around it lives one level up).

    request      a request's state (tokens, placeholders, blocks) and its finish reasons
    config       the core's knobs (SchedulerConfig)
    admission    may a request wait at all (its worst-case blocks fit the pool)
    policy       which waiting / running request goes first (fcfs, priority, score)
    block_pool   KV blocks: free list, refcounts, prefix-cache hashes, fenced frees
    kv_manager   a request's blocks: allocate, share a cached prefix, free, swap
    running_set  the running requests as numpy columns (the bulk decode path reads them)
    decodes      a step's plain decodes, for all running requests at once
    token_rules  how many tokens a request computes, and whether a token ends it
    speculation  n-gram drafts: how many a request may take, what a result accepts
    step_builder one step's plan: decodes, prefill chunks, preemptions, swaps
    commit       a result applied: tokens committed, requests finished, blocks freed
    logprob_events / events   what the gateways are told (token events, finishes)
    integrity    check_integrity(): every block and counter accounted for
    stats        counters the daemon exports
    scheduler    Scheduler: the above composed into schedule() / update()
"""
