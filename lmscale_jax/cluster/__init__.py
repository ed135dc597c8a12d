"""Who the processes of a job are, how they start, agree, and leave."""
